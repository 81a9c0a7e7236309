"""Data parallelism with the same bits at every world size: a plain loop, `InvariantDataParallel`.

    torchrun --standalone --nproc-per-node 2 examples/topology/dp.py
    detrace check-topology --worlds 1,2,4 -- python examples/topology/dp.py

The contract (docs/topology.md): the process group even at one process (torchrun), the same global batch of M
microbatches on every rank, each microbatch's loss scaled by a global constant (never a per-rank count).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import detrace
from detrace.parallel import InvariantDataParallel

M, B, STEPS = 4, 8, 3  # M microbatches of B samples per global batch: M divisible by every world size checked


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # nccl on GPUs
    detrace.deterministic(0)  # every rank seeded alike: the same initial weights
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idp = InvariantDataParallel(model, microbatches=M)
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)  # the global batch, the same on every rank
        x, y = torch.randn(M, B, 16, generator=data), torch.randint(0, 4, (M, B), generator=data)

        def loss_of(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:  # global microbatch i
            return nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") / (M * B)  # a global constant

        idp.backward(loss_of)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
