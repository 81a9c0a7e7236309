"""Pipeline parallelism (torch.distributed.pipelining) with the same bits at every number of stages and schedule.

    torchrun --standalone --nproc-per-node 2 examples/topology/pipeline.py       # DETRACE_LAYOUT=pp2: 2 stages
    detrace check-topology --layouts pp1,pp2 -- python examples/topology/pipeline.py

The contract (docs/topology.md): the process group even at one process (torchrun), the number of stages from
DETRACE_LAYOUT (`pp2`), each stage keeping its layers under the whole model's names, the same global batch of M
microbatches, each microbatch's loss scaled by a global constant and the schedule's own scaling off
(`scale_grads=False`): each stage sums its microbatches' gradients in the fixed tree (`TreeGradients`) and runs
microbatch i's forward under microbatch i's generators (`SeededForwards`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import detrace
from detrace.parallel import Layout, SeededForwards, TreeGradients
from detrace.parallel.data import step_seed

M, B, STEPS, LAYERS = 4, 8, 3, 4


class Net(nn.Module):
    """An input projection, LAYERS blocks and a head; a stage keeps its own part under the same names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(16, 32)
        # No dropout: SeededForwards seeds a stage's forward as a whole, so the draws of a layer depend on the random
        # layers before it in its stage (docs/topology.md)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(32, 32), nn.GELU()) for i in range(LAYERS)})
        self.head: nn.Module | None = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x

    def keep_stage(self, stage: int, stages: int) -> Net:
        """Cut down to stage `stage` of `stages`: contiguous layers, the projection first, the head last."""
        per = LAYERS // stages
        for i in range(LAYERS):
            if not stage * per <= i < (stage + 1) * per:
                del self.layers[str(i)]
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.head = None
        return self


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stages = Layout.parse(os.environ.get("DETRACE_LAYOUT", f"pp{dist.get_world_size()}")).size("pp")
    stage = dist.get_rank()
    detrace.deterministic(0)  # every rank builds the whole model alike, then keeps its stage
    model = Net().keep_stage(stage, stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads, seeds = TreeGradients(model.parameters(), M), SeededForwards(model, torch.device("cpu"))
    hidden = torch.empty(B, 32, requires_grad=True)  # an example of the activations between stages
    pipe = PipelineStage(model, stage, stages, torch.device("cpu"),
                         input_args=torch.empty(B, 16) if stage == 0 else hidden,
                         output_args=torch.empty(B, 4) if stage == stages - 1 else hidden)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y, reduction="sum") / (M * B)  # a global constant

    schedule = ScheduleGPipe(pipe, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)  # the global batch, the same on every rank
        x, y = torch.randn(M * B, 16, generator=data), torch.randint(0, 4, (M * B,), generator=data)
        seeds.begin(step_seed())  # the step's one draw, the same on every stage
        grads.begin()
        if stages == 1:
            schedule.step(x, target=y)
        elif stage == 0:
            schedule.step(x)
        elif stage == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        grads.finish()  # each .grad: the tree over the M microbatches
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
