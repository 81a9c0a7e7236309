"""`detrace compare BASE_A BASE_B CANDIDATE`: is an intentional change's effect real, or run-to-run noise?

The noise model is `detrace.analyze.noise` (this module parses the arguments and renders its result). Exit codes: 0
identical or noise, 1 real, 2 when a run cannot be compared with BASE_A record by record (other world size, rung
or windows): metrics of such runs say nothing about the change.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from detrace.analyze import Divergence
from detrace.analyze.noise import DEFAULT_FACTOR, NoiseResult, noise_test
from detrace.cli._args import ArgumentParser
from detrace.report.terminal import make_console


def _describe(first: Divergence | None) -> str:
    if first is None:
        return "identical"
    return (f"step {first.step}, rank {first.rank}: {first.phase} {first.name}"
            + (f" in {first.module}" if first.module else ""))


def main(argv: list[str]) -> int:
    parser = ArgumentParser("compare", "Set a candidate run against the natural variation between two baseline "
                            "runs: per-step metric differences, and where the change first shows in the trace. "
                            "Exit 0 when the candidate is identical or within the noise, 1 when its effect is real.")
    parser.add_argument("base_a", metavar="BASE_A", type=Path, help="a run of the unchanged program")
    parser.add_argument("base_b", metavar="BASE_B", type=Path, help="another run of the unchanged program")
    parser.add_argument("candidate", metavar="CANDIDATE", type=Path, help="a run of the changed program")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                        help="how many times the baselines' spread an effect must exceed (default %(default)s)")
    parser.add_argument("--rank", type=int, default=None, help="rank whose metrics to compare (default: lowest)")
    parser.add_argument("--json", action="store_true", help="print the detrace.compare/1 object on stdout")
    args = parser.parse_args(argv)
    result = noise_test(args.base_a, args.base_b, args.candidate, factor=args.factor, rank=args.rank)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        _render(result, make_console())
    return result.exit_code


def _render(result: NoiseResult, console: Console) -> None:
    for metric in result.metrics:
        table = Table("step", "A", "B", "candidate", "noise |A-B| so far", "effect |C-mid|", "",
                      title=f"{metric.name}: {metric.verdict}", title_justify="left")
        for row in metric.steps:
            mark = "[red]beyond[/]" if row["beyond"] else ("within" if row["differs"] else "")
            table.add_row(str(row["step"]), f"{row['a']:.9g}", f"{row['b']:.9g}", f"{row['candidate']:.9g}",
                          f"{row['noise']:.3g}", f"{row['effect']:.3g}", mark)
        console.print(table)
    text = {"real": "the change's effect is real: beyond the baselines' run-to-run variation",
            "noise": "the change's effect is within the baselines' run-to-run variation (noise)",
            "identical": "the candidate's metrics are bit-identical to the baseline"}[result.verdict]
    console.print(f"[bold]{result.verdict}[/]: {text} (rank {result.rank}, factor {result.factor:g})")
    console.print(f"  trace: baselines first differ at {_describe(result.baselines)}")
    console.print(f"         candidate first differs from BASE_A at {_describe(result.candidate)}")
