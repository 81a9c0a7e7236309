"""A 2-rank training script for the launcher tests: DDP, FSDP2, functional collectives (an expert-parallel style
all_to_all_single_autograd and a DTensor redistribute, both with their backward), explicit collectives and p2p,
on gloo.

Prints one line per rank: `final RANK <sha256 of the final parameters' bytes>` so that runs with and without
the tracer can be compared bit for bit. Run with torchrun, or with `spawn` as argv[1] to use mp.spawn.
"""

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from detrace._exit import leave


def params_hash(*models: nn.Module) -> str:
    h = hashlib.sha256()
    for model in models:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            h.update(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(rank: int, world: int) -> None:
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    fsdp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    fully_shard(fsdp)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    opt_fsdp = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    mesh = init_device_mesh("cpu", (world,))
    exchange = nn.Linear(8, 8)  # not wrapped: its tokens go through all_to_all and a DTensor all-gather
    opt_exchange = torch.optim.SGD(exchange.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    steps = int(os.environ.get("TRAIN_STEPS", "3"))
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen) / 3  # non-power-of-two scalings exercise the bucket's rounding
        tokens = all_to_all_single_autograd(exchange(torch.randn(12, 8, generator=gen)), None, None, dist.group.WORLD)
        gathered = DTensor.from_local(tokens, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
        loss = ddp(x).pow(2).mean() + fsdp(x).pow(2).mean() + gathered.tanh().pow(2).mean()
        loss.backward()
        for opt in (opt_ddp, opt_fsdp, opt_exchange):
            opt.step()
            opt.zero_grad()
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, async_op=True).wait()
        if rank == 0:
            dist.send(t * 2, dst=1)
        elif rank == 1:
            dist.recv(t, src=0)
    print(f"final {rank} {params_hash(ddp, fsdp, exchange)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    leave(0)  # gloo's threads outlive the group: no interpreter finalization to race with


def spawned(rank: int, world: int, port: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    train(rank, world)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(2, sys.argv[2]), nprocs=2)
    else:
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size())
