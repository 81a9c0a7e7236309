"""A plain PyTorch loop trained with `detrace.parallel.InvariantDataParallel`: the same bits at any world size.

    python examples/invariant_dp.py --microbatches 4
    torchrun --standalone --nproc-per-node 2 examples/invariant_dp.py --microbatches 4
    detrace check-topology --worlds 1,2,4 -- python examples/invariant_dp.py --microbatches 4

Rank 0 prints `step S loss <bits>` per step and `final params <16 hex digits>` at the end: the same lines at
every world size. It follows detrace's resume contract with an elastic `TrainState` (every rank holds the same
state; the data position is the step, each step's global batch drawn from a generator seeded by it), so a run
stopped on 2 ranks resumes on 1 or 4 with the same bits:

    detrace check-topology --worlds 2,1,4 --resume-at 1 -- python examples/invariant_dp.py
 `--reduce naive` trains the usual way instead (each rank accumulates its microbatches in
running order, then one all-reduce): a topology-dependent reduction, kept as the negative case of the tests.
"""

from __future__ import annotations

import argparse
import os
import struct

import torch
import torch.distributed as dist
from torch import nn

import detrace
from detrace.parallel import InvariantDataParallel, owned_microbatches, parameters_fingerprint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (give it explicitly)")
    p.add_argument("--reduce", choices=("invariant", "naive"), default="invariant")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    detrace.deterministic(0)  # every generator seeded alike on every rank: the same weights, the same draws
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # elastic: every rank's state is the same (checked on save), so a checkpoint resumes at any world size
    state = detrace.TrainState(model=model, optimizer=optimizer, elastic=args.reduce == "invariant")
    start = state.resume_if_requested()
    M, B = args.microbatches, args.microbatch_size
    global_count = M * B  # the loss is scaled by the global sample count, never a per-rank one
    idp = InvariantDataParallel(model, microbatches=M) if args.reduce == "invariant" else None
    for step in range(start, args.steps):
        data = torch.Generator().manual_seed(step)  # the global batch: the same on every rank
        x, y = torch.randn(M, B, 32, generator=data), torch.randint(0, 8, (M, B), generator=data)

        def loss_of(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") / global_count

        if idp is not None:
            loss = idp.backward(loss_of)
        else:
            loss = torch.zeros(())
            for i in owned_microbatches(M):  # running order, accumulated into .grad
                mb_loss = loss_of(i)
                mb_loss.backward()
                loss += mb_loss.detach()
            if dist.is_initialized():
                for q in model.parameters():
                    dist.all_reduce(q.grad)  # type: ignore[arg-type]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"step {step} loss 0x{struct.pack('>f', float(loss)).hex()}", flush=True)
        if state.end_of_step(step + 1):
            break
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"final params {parameters_fingerprint(model)}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
