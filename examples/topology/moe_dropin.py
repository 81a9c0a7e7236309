"""An all-to-all MoE written the torchtitan way, the same bits on every dp x ep mesh with detrace's imports.

    detrace check-topology --layouts ep1,ep2,ep4,dp2xep2 -- python examples/topology/moe_dropin.py --api detrace
    detrace check-topology --layouts ep1,ep2,ep4,dp2xep2 -- python examples/topology/moe_dropin.py --api torch

A small MoE transformer-ish model: token embedding, then blocks of (RMSNorm, a dense mixing layer, RMSNorm, an MoE:
a top-2 router, torchtitan's `GroupedExperts` and a shared dense expert), then a norm and the head. The experts go to
`parallelize_module(block.moe.experts, mesh["ep"], ExpertParallel())`, the rest to `fully_shard` over every data rank
(the ep ranks split the data too, as in torchtitan; the experts' weights are the style's, `ignored_params` there).
The loop is torchtitan's gradient accumulation: the global batch is M microbatches drawn from a generator seeded by
the step; data rank d E + e (rank (d, e) of the (dp, ep) mesh) runs microbatches [(d E + e) n, (d E + e + 1) n)
with n = M / W, one backward each, each loss scaled by 1 / n.

`--api` changes only where `ExpertParallel`, `parallelize_module` and `fully_shard` come from. torch has no
expert-parallel style: `--api torch` takes the one below, torchtitan's (the counts, then the rows, with the
all-to-all; the rows permuted by local expert; each local expert one GEMM over every source rank's rows, autograd
adding up its weight gradient), with torchtitan's average of the experts' gradients over the W data ranks (there
FSDP's gradient divide factor; here an all-reduce over the dp replicas and a division before the optimizer step).
It is the control: its expert gradients change with E. `--api torch-experts` keeps detrace's `fully_shard` and
takes that style alone: the experts' own control.

The layout comes from DETRACE_LAYOUT (`ep1`, `ep2`, `ep4`, `dp2xep2`), which `check-topology --layouts` sets.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd  # torchtitan's all-to-all
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace.parallel.layout import LAYOUT_ENV, Layout

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, BLOCKS = 64, 16, 32, 4, 2, 2  # EXPERTS divisible by every ep size checked


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: EXPERTS SwiGLU experts; x [T, DIM] sorted by expert, num_tokens_per_expert
    [EXPERTS] rows each -> [T, DIM], expert e run on its rows (its for-loop form)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN ** -0.5)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * DIM ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, rows in enumerate(x.split(num_tokens_per_expert.tolist())):
            h = nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)
            outs.append(h @ w2[e].T)
        return torch.cat(outs)


class MoE(nn.Module):
    """A token-choice top-TOP_K router, the routed experts and a shared expert (torchtitan's MoE, softmax scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        scores, chosen = nn.functional.softmax(self.gate(tokens), dim=-1).topk(TOP_K, dim=-1)
        order = torch.argsort(chosen.view(-1), stable=True)  # the (token, k) pairs sorted by expert
        counts = torch.bincount(chosen.view(-1), minlength=EXPERTS)
        routed = self.experts(tokens[order // TOP_K], counts) * scores.view(-1, 1)[order]
        out = torch.zeros_like(tokens).index_add(0, order // TOP_K, routed)  # each token's TOP_K rows, in order
        return (out + self.shared(tokens)).view_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.mix, self.norm2, self.moe = nn.RMSNorm(DIM), nn.Linear(DIM, DIM), nn.RMSNorm(DIM), MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class TorchExpertParallel(ParallelStyle):
    """torchtitan's ExpertParallel, the ordinary all-to-all (torch has none of its own): the experts sharded on dim
    0 over the ep mesh; an input hook that sends the counts, then the rows, and permutes them by local expert; an
    output hook that reverses it."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def _dispatch(self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, counts = inputs
        ep, group = mesh.size(), mesh.get_group()
        received = torch.empty_like(counts)  # [s L + e]: source s's rows for my local expert e
        dist.all_to_all_single(received, counts, group=group)
        self.send, self.recv = counts.view(ep, -1).sum(1).tolist(), received.view(ep, -1).sum(1).tolist()
        rows = all_to_all_single_autograd(rows, self.recv, self.send, group)
        sizes = received.tolist()  # source-major; the experts take their rows expert-major
        starts = torch.tensor([0, *sizes]).cumsum(0)
        local = len(sizes) // ep
        self.order = torch.cat([torch.arange(int(starts[s * local + e]), int(starts[s * local + e + 1]))
                                for e in range(local) for s in range(ep)]).long()
        return rows[self.order], received.view(ep, -1).sum(0)

    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        back = torch.empty_like(out).index_copy(0, self.order, out)  # source-major again
        return all_to_all_single_autograd(back, self.send, self.recv, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torchtitan averages the experts' gradients over the W data ranks (FSDP's gradient divide factor there):
        # here an all-reduce over the dp replicas, in the collective's order, and a division, before each step
        def average(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for w in module.parameters(recurse=False):
                if w.grad is not None and id(w) in owned:
                    local = w.grad.to_local()
                    dist.all_reduce(local, group=REPLICAS[0])  # the replicas of the last model built
                    local.div_(dist.get_world_size())

        register_optimizer_step_pre_hook(average)
        return distribute_module(module, device_mesh, self._partition, input_fn=self._dispatch,
                                 output_fn=self._combine)


REPLICAS: list[dist.ProcessGroup] = []
"""The experts' dp replicas, for the style above (detrace's reads them from the mesh the ep mesh was sliced from)."""


def imports(api: str) -> tuple[Any, Any, Any]:
    """(ExpertParallel, parallelize_module, fully_shard) from detrace or from torch (and the style above); or, for
    `torch-experts`, detrace's fully_shard with the style above (the experts alone as the control)."""
    if api == "detrace":
        from detrace.parallel import ExpertParallel, fully_shard, parallelize_module
    elif api == "torch-experts":
        from torch.distributed.tensor.parallel import parallelize_module  # type: ignore[assignment]

        from detrace.parallel import fully_shard

        ExpertParallel = TorchExpertParallel  # type: ignore[misc]
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import parallelize_module  # type: ignore[assignment]

        ExpertParallel = TorchExpertParallel  # type: ignore[misc]
    return ExpertParallel, parallelize_module, fully_shard


def build(api: str, mesh: DeviceMesh, data: DeviceMesh) -> Model:
    """The model, the same whole one on every rank, its experts given to ExpertParallel over mesh["ep"] and the rest
    to fully_shard over `data` (every rank)."""
    ExpertParallel, parallelize_module, fully_shard = imports(api)
    REPLICAS[:] = [mesh.get_group("dp")]
    torch.manual_seed(0)  # the same whole model on every rank; the styles keep their shards
    model = Model()
    experts = []
    for block in model.blocks:
        parallelize_module(block.moe.experts, mesh["ep"], ExpertParallel())
        experts += list(block.moe.experts.parameters())
        fully_shard(block, mesh=data, ignored_params=set(block.moe.experts.parameters()))
    fully_shard(model, mesh=data, ignored_params=set(experts))
    return model


def train_step(model: Model, optimizer: torch.optim.Optimizer, step: int, microbatches: int) -> None:
    """torchtitan's gradient accumulation over the step's global batch of `microbatches`: this rank's share (data
    rank d E + e, rank (d, e) of the (dp, ep) mesh: the global rank), one backward each, each loss scaled by 1 / n."""
    n = microbatches // dist.get_world_size()
    rank = dist.get_rank()
    batch = torch.randint(0, VOCAB, (microbatches, 4, 9), generator=torch.Generator().manual_seed(step))
    for i in range(rank * n, (rank + 1) * n):
        tokens = batch[i]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        (loss / n).backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("detrace", "torch", "torch-experts"), default="detrace")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)  # index_add's backward on CPU
    if "WORLD_SIZE" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    dist.init_process_group("gloo")  # nccl on GPUs
    world = dist.get_world_size()
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, f"ep{world}"))
    dp, ep = layout.size("dp"), layout.size("ep")
    if dp * ep != world or layout.dims - {"dp", "ep"}:
        raise SystemExit(f"layout {layout.name} is not a dp x ep mesh of {world} ranks")
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))  # ep inside: torchtitan's order
    data = init_device_mesh("cpu", (world,), mesh_dim_names=("data",))  # every rank: the dense layers' data ranks
    model = build(args.api, mesh, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        train_step(model, optimizer, step, args.microbatches)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
