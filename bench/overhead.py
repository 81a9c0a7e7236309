"""Tracer overhead: step time of the reference model at each rung, relative to the same step untraced.

The reference model runs at one of its presets (`detrace.examples.model.PRESETS`): `small` (the default) is a
small transformer-style training step (dim 256, 8 layers, 16 experts, batch 16 x 128 tokens); `tiny` (dim 64,
4 layers, batch 8 x 32 tokens) is the stress case, where thousands of sub-millisecond ops make the tracer's
fixed cost per record show.

All variants run in one process, interleaved (untraced, metrics, semantic, module, op, op outside its window,
then again), so that machine noise hits them alike; each ratio is the median over repeats of
(median traced step time / median untraced step time of the same repeat). "outside window" traces at the op
rung with `steps="0"`, measured on later steps: the cost of rungs that are switched off.

The last lines are the figures, one per line: `overhead RUNG: 1.004x`.

    python bench/overhead.py [--preset small] [--repeats 5] [--steps 3] [--warmup 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

import detrace
from detrace.examples.model import PRESETS, HybridLM, ModelConfig, objective

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


def time_steps(step: Callable[[], None], variant: str, out: Path, warmup: int, steps: int) -> float:
    """Median seconds per step over `steps` steps after `warmup` (the window variant's step 0 is a warmup)."""
    times = []
    with tracing(variant, out):
        for i in range(warmup + steps):
            start = time.perf_counter()
            step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and repeat")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    config = preset["model"]
    assert isinstance(config, ModelConfig)
    batch, seq = int(preset["batch_size"]), int(preset["seq_len"])  # type: ignore[call-overload]
    step = make_step(config, batch, seq)
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            medians = {}
            for variant in VARIANTS:
                out = Path(tmp) / f"{repeat}-{variant.replace(' ', '-')}"
                medians[variant] = time_steps(step, variant, out, args.warmup, args.steps)
            for variant in VARIANTS[1:]:
                ratios[variant].append(medians[variant] / medians["untraced"])
            print(f"repeat {repeat}: untraced {medians['untraced'] * 1e3:.1f} ms/step; "
                  + ", ".join(f"{v} {medians[v] * 1e3:.1f}" for v in VARIANTS[1:]), flush=True)
    print(f"model: preset {args.preset}, HybridLM {config.pattern} dim {config.dim}, batch {batch}, seq {seq}, "
          f"threads {args.threads}, {args.repeats} repeats x {args.steps} steps")
    for variant in VARIANTS[1:]:
        print(f"overhead {args.preset} {variant}: {statistics.median(ratios[variant]):.3f}x")


if __name__ == "__main__":
    main()
