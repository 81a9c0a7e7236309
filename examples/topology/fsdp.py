"""FSDP (`fully_shard`) with the same bits at every number of shards: the fixed tree in its reduce-scatter.

    torchrun --standalone --nproc-per-node 2 examples/topology/fsdp.py
    detrace check-topology --layouts fsdp1,fsdp2,fsdp4 -- python examples/topology/fsdp.py

The contract (docs/topology.md): the process group even at one process (torchrun), the same global batch of M
microbatches on every rank, each microbatch's loss scaled by a global constant. Nothing to print: the tracer records
each sharded parameter by its shards' parts of the global fingerprint, which check-topology adds up, so every
parameter is compared after every step at every number of shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import detrace
from detrace.parallel import invariant_backward, shard_invariantly
from detrace.parallel.fsdp import check_complete

M, B, STEPS = 4, 8, 3


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    detrace.deterministic(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comms = shard_invariantly(model, microbatches=M // world)  # this rank's share of the M microbatches
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(M, B, 16, generator=data), torch.randint(0, 4, (M, B), generator=data)

        def loss_of(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:  # global microbatch i
            return nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") / (M * B)  # a global constant

        invariant_backward(model, loss_of, microbatches=M, group=mesh.get_group(), sharded=True)
        check_complete(comms)  # every FSDP module took every microbatch's gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
