"""Replica guard overhead: the reference model's DDP step with the guard checking every step (N=1), relative to
the same step unguarded, on gloo.

Both variants run in the same two ranks, interleaved step by step (unguarded, guarded, unguarded, ...), so machine
noise hits them alike: the guard is installed before a guarded step and removed after it, on both ranks. The
ratio is mean(guarded) / mean(unguarded) over the measured steps, with a 95% bootstrap interval over step pairs,
and the guard's own time per check (digests and all-gather, both ranks starting it together) as a share of
the step.

    python bench/guard.py [--preset small] [--steps 20] [--warmup 2] [--threads 1]

The last lines are the figures, one per line.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _worker(args: argparse.Namespace) -> None:
    from detrace._exit import leave
    from detrace.defects.guard import Guard
    from detrace.workload import layouts
    from detrace.workload import sharding as parallel
    from detrace.workload.model import PRESETS

    torch.set_num_threads(args.threads)
    layout = layouts.setup("ddp")
    preset = PRESETS[args.preset]
    batch, seq = int(preset["batch_size"]), int(preset["seq_len"])  # type: ignore[call-overload]
    pm = parallel.ParallelModel(preset["model"], layout, seed=0, batch_size=batch, seq_len=seq)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(pm.raw.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(layout.rank)
    vocab = pm.cfg.vocab_size
    times: dict[bool, list[float]] = {False: [], True: []}
    checks: list[float] = []
    guard = Guard(every=1, mode="warn")
    for i in range(2 * (args.warmup + args.steps)):
        guarded = i % 2 == 1
        if guarded:
            guard.install()
        tokens = torch.randint(0, vocab, (batch, seq + 2), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        pm.forward_backward(tokens[:, :seq], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if guarded:
            guard.remove()
            if i >= 2 * args.warmup:  # the guard's own cost, measured alone on the same state
                # Both ranks start the check together: the time one rank would wait in the all-gather for the
                # other to finish its step is not the guard's (unguarded, it waits as long in the next all-reduce).
                dist.barrier()
                check = time.perf_counter()
                guard.check(optimizer, step=0)
                checks.append(time.perf_counter() - check)
        if i >= 2 * args.warmup:
            times[guarded].append(elapsed)
    if layout.rank == 0:
        plain, guarded_times = times[False], times[True]
        ratio = statistics.fmean(guarded_times) / statistics.fmean(plain)
        rng = random.Random(0)
        pairs = list(zip(plain, guarded_times, strict=True))
        boots = []
        for _ in range(2000):
            sample = [rng.choice(pairs) for _ in pairs]
            boots.append(statistics.fmean(g for _, g in sample) / statistics.fmean(p for p, _ in sample))
        boots.sort()
        low, high = boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots))]
        spread = statistics.pstdev(plain) / statistics.fmean(plain)
        print(f"preset {args.preset}, ddp x2 on gloo, {args.steps} step pairs, {args.threads} thread(s) per rank; "
              f"unguarded step {statistics.fmean(plain):.3f} s (spread {100 * spread:.1f}%)", flush=True)
        print(f"guard overhead N=1: {ratio:.4f}x (95% CI {low:.4f}-{high:.4f})", flush=True)
        print(f"guard check alone: {1000 * statistics.median(checks):.2f} ms "
              f"({100 * statistics.median(checks) / statistics.fmean(plain):.2f}% of the step)", flush=True)
    layouts.teardown(layout, completed=True)
    leave(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20, help="measured step pairs")
    p.add_argument("--warmup", type=int, default=2, help="step pairs before measuring")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", "--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]
    return subprocess.call(cmd, env=os.environ.copy())


if __name__ == "__main__":
    sys.exit(main())
