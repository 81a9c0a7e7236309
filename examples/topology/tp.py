"""Tensor parallelism (and data parallelism around it: a D x T mesh) with the same bits on every mesh.

    torchrun --standalone --nproc-per-node 4 examples/topology/tp.py                 # DETRACE_TP=2: a 2x2 mesh
    detrace check-topology --layouts 1x1,1x2,2x1,2x2 -- python examples/topology/tp.py

The contract (docs/topology.md): the process group even at one process (torchrun), T from DETRACE_TP (which
check-topology sets for each D x T layout), the same full weights built on every rank before the tensor-parallel
layers keep their chunks, the same global batch of M microbatches on every rank (the T ranks of one data-parallel
block compute the same ones), each microbatch's loss scaled by a global constant.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import detrace
from detrace.parallel import ColumnParallelLinear, InvariantDataParallel, RowParallelLinear

M, B, STEPS, CHUNK = 4, 8, 3, 8  # CHUNK: features per chunk, fixed by the model (64 / 8 = 8 chunks: T up to 8)


class MLP(nn.Module):
    """x -> up (column-parallel) -> GELU -> down (row-parallel) + a replicated bias -> head."""

    def __init__(self, tp: dist.ProcessGroup) -> None:
        super().__init__()
        whole_up, whole_down = nn.Linear(16, 64, bias=False), nn.Linear(64, 16, bias=False)  # the same on every rank
        self.up = ColumnParallelLinear(whole_up.weight, chunk=CHUNK, group=tp)  # keeps this rank's chunks of rows
        self.down = RowParallelLinear(whole_down.weight, chunk=CHUNK, group=tp)
        self.bias = nn.Parameter(torch.zeros(16))  # after the row layer: the whole output on every rank
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(nn.functional.gelu(self.up(x))) + self.bias)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    T = int(os.environ.get("DETRACE_TP", "1"))
    mesh = init_device_mesh("cpu", (dist.get_world_size() // T, T), mesh_dim_names=("dp", "tp"))
    detrace.deterministic(0)  # every rank builds the same whole weights
    model = MLP(mesh.get_group("tp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idp = InvariantDataParallel(model, microbatches=M, group=mesh.get_group("dp"))
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(M, B, 16, generator=data), torch.randint(0, 4, (M, B), generator=data)

        def loss_of(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:  # global microbatch i
            return nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") / (M * B)

        idp.backward(loss_of)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
