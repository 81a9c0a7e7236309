"""`detrace ablate --step S --run RUN [--from CKPT] [--metric loss] [--variant NAME=SPEC ...] [--window W] [--json]
-- CMD`: replay the spike at step S from a checkpoint and change one thing at a time (`detrace.investigate.ablate`).

Exit 0 when the baseline replay does not spike at S, 1 when the variants gave a verdict, 2 on error or when the
replay does not reproduce the original run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.errors import DetraceError
from detrace.investigate.ablate import (
    DEFAULT_AFTER,
    SCHEMA,
    AblateConfig,
    AblateResult,
    Launch,
    Outcome,
    ablate,
    launcher,
)
from detrace.investigate.spikes import DEFAULT_K, DEFAULT_METRIC, SpikeRule
from detrace.investigate.spikes import DEFAULT_WINDOW as DEFAULT_TRAIL
from detrace.report.html import write_report
from detrace.tracefile import write_json_atomic
from detrace.tracefile.layout import ABLATE_FILE, prepare_out


def run_ablation(config: AblateConfig, launch: Launch, progress: Callable[[str], None] = lambda line: None, *,
                 force: bool = False) -> AblateResult:
    """`ablate` into `config.out`, which must be new or empty (or `force`): writes ablate.json and report.html."""
    config = dataclasses.replace(config, out=config.out.resolve())
    prepare_out(config.out, holds="runs", force=force, name="--out")
    result = ablate(config, launch, progress)
    write_json_atomic(config.out / ABLATE_FILE, result.to_json())
    write_report(config.out)
    return result


def render(result: AblateResult) -> None:
    """The terminal summary."""
    print(f"{result.verdict}: {result.summary}")
    base = result.baseline
    config = result.config
    threshold = "-" if result.threshold is None else f"{result.threshold:.6g}"
    original = result.original.get(config.step)
    print(f"  step {config.step}  {config.metric}: original {original if original is None else f'{original:.6g}'}"
          f", threshold {threshold}, checkpoint after {result.checkpoint} steps")
    if base is not None:
        shown = "-" if base.value is None else f"{base.value:.6g}"
        print(f"  baseline           {shown:>10}  {'spikes' if base.spiked else 'no spike'}  ({base.run})")
    for o in result.outcomes:
        if o.unavailable is not None:
            print(f"  {o.variant.name:<18} {'-':>10}  unavailable  {o.variant.change}; {o.unavailable}")
            continue
        shown = "-" if o.value is None else f"{o.value:.6g}"
        where = "identical" if o.departure is None and o.variant.start >= result.checkpoint else (
            o.departure.where() if o.departure else f"starts from the checkpoint after {o.variant.start} steps")
        at = "" if o.at == config.step else f" at step {o.at}"
        print(f"  {o.variant.name:<18} {shown:>10}  {'spikes' if o.spiked else 'no spike':<8}{at}  "
              f"{o.variant.change}; departs: {where}")
    if result.samples is not None:
        bisected = result.samples
        named = "-" if bisected.culprit is None else f"dataset index {bisected.culprit}"
        print(f"  samples  of step {bisected.step}: {', '.join(map(str, bisected.indices)) or 'not recorded'}; "
              f"the one it needs: {named}")
        for o in bisected.replays:
            _replay(o)
    if result.split is not None:
        parts = ", ".join(result.split.parts) or "-"
        print(f"  state    at step {result.checkpoint}, one part at a time from the checkpoint after "
              f"{result.split.earlier} steps; the part that carries it: {parts}")
        for o in result.split.replays:
            _replay(o)
    print(f"  cost     {len(result.runs)} runs, {result.steps} steps, {result.seconds:.1f} s; kept in {config.out}")
    print(f"  report   {config.out / 'report.html'}")


def _replay(o: Outcome) -> None:
    """One line for a replay of the bisection or the split: its metric, whether it spikes, what it changes."""
    shown = "-" if o.value is None else f"{o.value:.6g}"
    state = "unavailable" if o.unavailable is not None else "spikes" if o.spiked else "no spike"
    print(f"  {o.variant.name:<18} {shown:>10}  {state:<8}  {o.variant.change}")


def main(argv: list[str]) -> int:
    options, command = split_command(argv)
    try:
        return _ablate(options, command)
    except DetraceError as err:
        if "--json" not in options:
            raise
        print(json.dumps({"schema": SCHEMA, "verdict": "error", "message": str(err)}, indent=1))
        print(f"detrace ablate: error: {err}", file=sys.stderr)
        return err.exit_code


def _ablate(options: list[str], command: list[str]) -> int:
    parser = ArgumentParser(
        "ablate", "Replay the spike at step S from the last checkpoint before it (proving that the replay "
        "reproduces the original traced run), then change one thing at a time: skip its batches, feed them from an "
        "earlier state, keep the state with other data, or your own variants; for a data verdict, bisect the spike's "
        "batch down to the sample; for a state verdict, take the learning rate, the optimizer's moments or the "
        "weights from the checkpoint before it, one at a time, to name the part that carries it. Exit 0 no spike "
        "in the replay, 1 verdict given, 2 error or not reproducible.",
        epilog="usage: detrace ablate --step S --run RUN -- CMD...")
    parser.add_argument("--step", type=int, required=True, metavar="S", help="global step of the spike")
    parser.add_argument("--run", type=Path, required=True, metavar="RUN",
                        help="the original run, traced with detrace run (its run.json names its checkpoints)")
    parser.add_argument("--from", dest="checkpoint", type=Path, default=None, metavar="CKPT",
                        help="the checkpoint to replay from (default: the last one the run saved before S)")
    parser.add_argument("--checkpoints", type=Path, default=None, metavar="DIR",
                        help="the run's checkpoint directory (default: the DETRACE_CKPT_DIR its run.json names)")
    parser.add_argument("--metric", default=DEFAULT_METRIC, help="the metric that spikes (default %(default)s)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC",
                        help="a user variant: NAME=--extra args, or NAME=ENV:K=V[,K=V]; repeatable")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="skip-batches skips the batches of steps S-W..S (default: from the checkpoint C on, "
                             "the window every program accepts)")
    parser.add_argument("--after", type=int, default=DEFAULT_AFTER, help="steps each replay runs past S "
                        "(default %(default)s)")
    parser.add_argument("--k", type=float, default=DEFAULT_K, help="the threshold's MADs (default %(default)s)")
    parser.add_argument("--trail", type=int, default=DEFAULT_TRAIL,
                        help="the threshold's trailing window of steps (default %(default)s)")
    parser.add_argument("--no-builtins", action="store_true", help="run only the baseline and the user variants")
    parser.add_argument("--out", type=Path, default=None, help="directory for the runs (default detrace-ablate-<time>)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--timeout", type=seconds, default=None, help="seconds one run may take")
    parser.add_argument("--json", action="store_true", help=f"print the {SCHEMA} object on stdout")
    args = parser.parse_args(options)
    out = args.out or Path(f"detrace-ablate-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    config = AblateConfig(command=tuple(command), run=args.run, step=args.step, out=out, metric=args.metric,
                          rule=SpikeRule(k=args.k, window=args.trail), window=args.window, after=args.after,
                          checkpoint=args.checkpoint, checkpoints=args.checkpoints, variants=tuple(args.variant),
                          builtins=not args.no_builtins)
    result = run_ablation(config, launcher(args.timeout),
                          lambda line: print(f"detrace ablate: {line}", file=sys.stderr, flush=True), force=args.force)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        render(result)
    return result.exit_code
