"""`detrace spikes RUN [--metric loss] [--k K] [--window W] [--checkpoints DIR] [--json]`: the steps where a metric
jumps above median + k * MAD of its trailing window, each with the checkpoint to replay it from
(`detrace.investigate.spikes`). Exit 0 when there is none, 1 when there are spikes, 2 on error."""

from __future__ import annotations

import json
from pathlib import Path

from detrace.cli._args import ArgumentParser
from detrace.investigate.spikes import DEFAULT_K, DEFAULT_METRIC, DEFAULT_WINDOW, SpikeRule, SpikesResult, spikes


def render(result: SpikesResult) -> None:
    """The terminal summary: one line per spike."""
    rule = result.rule
    where = f"{result.metric} on rank {result.rank}, {result.steps} steps ({result.judged} judged), threshold " \
            f"median + {rule.k:g} x MAD of the {rule.window} steps before"
    if not result.spikes:
        print(f"clean: no spike in {where}")
        return
    print(f"spikes: {len(result.spikes)} in {where}")
    for spike in result.spikes:
        ckpt = (f"checkpoint after {spike.checkpoint} steps: {spike.checkpoint_path}" if spike.checkpoint is not None
                else "no checkpoint before it")
        if spike.finite:
            print(f"  step {spike.step}  {result.metric} {spike.value:.6g} > threshold {spike.threshold:.6g}  ({ckpt})")
        else:
            later = result.nonfinite - 1
            more = f"; {later} later step{'s' * (later != 1)} not finite either" if later else ""
            print(f"  step {spike.step}  {result.metric} {spike.value}: not finite{more}  ({ckpt})")
    if result.checkpoint_dir is None:
        print("  note: run.json names no checkpoint directory (the run was not given DETRACE_CKPT_DIR); "
              "give it with --checkpoints DIR")


def main(argv: list[str]) -> int:
    parser = ArgumentParser("spikes", "List the steps where a metric recorded at the metrics rung jumps above a "
                            "robust threshold (median + k x MAD of a trailing window), with the last checkpoint "
                            "before each. Exit 0 none, 1 spikes found, 2 error.")
    parser.add_argument("run", metavar="RUN", type=Path, help="a traced run directory (detrace run)")
    parser.add_argument("--metric", default=DEFAULT_METRIC, help="the metric to scan (default %(default)s)")
    parser.add_argument("--k", type=float, default=DEFAULT_K, help="MADs above the median (default %(default)s)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="trailing steps of the threshold (default %(default)s)")
    parser.add_argument("--rank", type=int, default=None, help="rank whose metric to scan (default: lowest)")
    parser.add_argument("--checkpoints", type=Path, default=None, metavar="DIR",
                        help="the run's checkpoint directory (default: the DETRACE_CKPT_DIR run.json names)")
    parser.add_argument("--json", action="store_true", help="print the detrace.spikes/1 object on stdout")
    args = parser.parse_args(argv)
    result = spikes(args.run, metric=args.metric, rule=SpikeRule(k=args.k, window=args.window), rank=args.rank,
                    checkpoints=args.checkpoints)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        render(result)
    return result.exit_code
