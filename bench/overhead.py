"""Tracer overhead: step time of the reference model at each rung, relative to the same step untraced.

The reference model runs at one of its presets (`detrace.workload.model.PRESETS`): `small` (the default) is a
small transformer-style training step (dim 256, 8 layers, 16 experts, batch 16 x 128 tokens); `tiny` (dim 64,
4 layers, batch 8 x 32 tokens) is the stress case, where thousands of sub-millisecond ops make the tracer's
fixed cost per record show.

All variants run in one process, interleaved at step granularity: each round times one step of every variant,
in a fresh random order, so that machine noise (which drifts over seconds) hits them alike. A round's ratio is
(traced step time / untraced step time of the same round); each figure is the geometric mean of the rounds'
ratios with its 95% confidence interval (Student's t on the log ratios), and the spread of the untraced step
itself is printed too, so a reader can see whether the machine could resolve a few percent. Each variant's
timed step is the second of a trace of its own: the first, untimed, pays what a trace costs once (the rank
file, the hooks). "outside window" traces at the op rung with `steps="0"` and times step 1: the cost of rungs
that are switched off.

The last lines are the figures, one per line: `overhead small op: 1.936x [1.90, 1.97]`.

`--clock cpu` times a step by this process's CPU time instead of wall time: on a machine shared with other work
it resolves what wall time cannot (the process runs 1 torch thread; the tracer's own threads are counted).

Where the module rung's time goes (profiles by CPU time, 1 thread, 2026-12-04 on the shared machine). On `small`,
about 7-9% over the untraced step: most of it is fingerprinting the calls' tensors (424 tensors, 745 MiB per step,
all but a few KiB distinct, hashed by fp1 at about 5.7 GiB per CPU-second: 130 ms, about 5% of the step: what the
rung records, left as it is); then `record.rungs.module._tag`, the walk of the autograd graph that names the module
owning each backward node; then the backward hooks' snapshots and the per-record column building
(`tracefile.columns`). The walk went from each call's outputs back to its inputs through every node its inner
modules had walked already, so nested modules walked the same nodes once per level (7,112 node visits per `small`
step for 2,227 nodes; 115 ms under the profiler). Now each walk keeps, on each output node, the lowest sequence
number of the nodes it found and the input nodes it reached, and an outer walk jumps over an inner call's region
when none of its own input nodes can lie inside it (`_walk` says why this gives the same tags; a test checks it
against the full walk on random nested calls): each node is visited once (2,227 visits, 45 ms under the profiler).
On the op rung, a third of the tracer's Python time outside the hashing went to building the trace's columns,
mostly a Python generator per value to find the nulls; `column` now finds them with `map(operator.is_, ...)` and
builds columns without nulls with no per-value Python code (a 100,000-row int column 7.3 -> 4.3 ms, a list column
32 -> 22 ms). The records are the same bits: every record of a traced `tiny` run at the op and module rungs is
equal before and after. What remains on the op rung is mostly the fingerprinting of every op's tensors (fp1's
kernel, compute-bound) and the per-call Python path of the dispatch mode and the snapshot memo.
Measured with `--clock cpu` at load average 1.5-4.8, before -> after: `small` (6 and 8 rounds) module 1.090x
[1.034, 1.148] -> 1.094x [1.065, 1.124], op 2.004x [1.907, 2.105] -> 2.013x [1.968, 2.060]; `tiny` (10 rounds)
module 1.943x [1.694, 2.230] -> 1.887x [1.817, 1.960], op 9.03x -> 8.81x: no change the bench resolves on `small`
(the walk was about 2% of its step), and the goals (module <= 1.10x, op <= 2x at the upper ends) were not met.
Then fp1's C kernel gained an AVX-512 DQ clone (native 64-bit multiplies: 35 GiB/s per core in cache, against the
AVX2 clone's 13.5), which cut the fingerprints' share of the step: on 2026-12-05 at load average 0.3-1.9, `small`
(8 rounds) module 1.060x [1.034, 1.086], op 1.910x [1.824, 2.000]; `tiny` module 1.801x [1.715, 1.892], op 9.65x
[8.21, 11.35]: both goals met on `small` at the upper ends, the op rung's only just.
Then both schemes' C kernels came to hash a tensor's rows and tail in one call, fp2's loop got faster and the
one-tensor `fingerprint` path's Python was halved (docs/fingerprint.md). On 2026-12-05 at 05:09-05:19 UTC, load
average 6.4 -> 3.5 while other tests ran (0.4 for `tiny`), `small` (8 rounds) module 1.092x [1.047, 1.139], op
1.832x [1.789, 1.876]; `tiny` module 1.755x [1.671, 1.843], op 9.35x [7.90, 11.06]: the op rung's goal met at the
upper end, the module rung's by the mean only (the one run made; the busier machine's shared bus and caches may
account for part of it, which `--clock cpu` does not remove).

    python bench/overhead.py [--preset small] [--rounds 20] [--warmup 2] [--threads 1] [--seed 0] [--clock wall]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

import detrace
from detrace.workload.model import PRESETS, HybridLM, ModelConfig, objective

VARIANTS = ("untraced", "metrics", "semantic", "module", "op", "outside window")


def make_step(config: ModelConfig, batch: int, seq: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = HybridLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 2), generator=gen)
        # inputs [B, T]; targets [B, T + 1]: the next token and, for the MTP head, the one after
        loss = objective(config, model(tokens[:, :seq]), tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def tracing(variant: str, out: Path) -> AbstractContextManager[object]:
    if variant == "untraced":
        return nullcontext()
    if variant == "outside window":
        return detrace.trace(out, rung="op", steps="0")
    return detrace.trace(out, rung=variant)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""`cpu` counts the CPU time of every thread of this process (the tracer's writer included) and nothing of other
processes: on a machine shared with other work it resolves what wall time cannot."""


def time_step(step: Callable[[], None], variant: str, out: Path, clock: Callable[[], float]) -> float:
    """Seconds of the second step of `variant`: the first, untimed, takes what a trace costs once (opening its
    rank file, installing hooks), and for the window variant it is step 0, inside its window."""
    with tracing(variant, out):
        step()
        start = clock()
        step()
        return clock() - start


# Student's t, two-sided 95%, by degrees of freedom (the normal 1.96 beyond 30)
_T95 = (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios and its 95% confidence interval."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = (_T95[len(logs) - 2] if len(logs) - 1 <= len(_T95) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per variant (one per round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round order of the variants")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what a step's time is")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    config = preset["model"]
    assert isinstance(config, ModelConfig)
    batch, seq = int(preset["batch_size"]), int(preset["seq_len"])  # type: ignore[call-overload]
    step = make_step(config, batch, seq)
    order = random.Random(args.seed)
    clock = CLOCKS[args.clock]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.warmup + args.rounds):
            variants = list(VARIANTS)
            order.shuffle(variants)
            sample = {v: time_step(step, v, Path(tmp) / f"{round_}-{v.replace(' ', '-')}", clock) for v in variants}
            if round_ >= args.warmup:
                for variant, seconds in sample.items():
                    times[variant].append(seconds)
                print(f"round {round_ - args.warmup}: " + ", ".join(f"{v} {sample[v] * 1e3:.1f} ms"
                                                                    for v in VARIANTS), flush=True)
    untraced = times["untraced"]
    spread = statistics.stdev(untraced) / statistics.fmean(untraced) if len(untraced) > 1 else math.nan
    print(f"model: preset {args.preset}, HybridLM {config.pattern} dim {config.dim}, batch {batch}, seq {seq}, "
          f"threads {args.threads}, {args.rounds} rounds, {args.clock} clock")
    print(f"untraced step: median {statistics.median(untraced) * 1e3:.1f} ms, min {min(untraced) * 1e3:.1f}, "
          f"max {max(untraced) * 1e3:.1f}, relative standard deviation {spread:.1%}")
    for variant in VARIANTS[1:]:
        ratios = [t / u for t, u in zip(times[variant], untraced, strict=True)]
        mean, low, high = interval(ratios)
        print(f"overhead {args.preset} {variant}: {mean:.3f}x [{low:.3f}, {high:.3f}] "
              f"(rounds from {min(ratios):.3f} to {max(ratios):.3f})")


if __name__ == "__main__":
    main()
