"""`detrace compare BASE_A BASE_B CANDIDATE`: is an intentional change's effect real, or run-to-run noise?

Two runs of the unchanged program (the baselines) measure the natural variation; a run of the changed program
(the candidate) is set against it, step by step and metric by metric:

- noise(t): the *envelope* of the baselines' spread, max over s <= t of |A(s) - B(s)|. Nondeterministic
  training drifts apart and rarely comes back, so the spread seen so far is a floor for the spread to come;
- effect(t): |C(t) - (A(t) + B(t)) / 2|, the candidate's distance from the baselines' midpoint;
- the candidate is *beyond* the noise at step t when effect(t) > factor x noise(t) (any effect is beyond a
  zero noise: bit-identical baselines make every difference real).

The verdict is "real" when the candidate is beyond the noise at most of the steps where any of the runs differ,
"noise" when it differs but mostly within the noise, "identical" when its metrics are bit-identical to BASE_A.
Two baselines give one sample of the spread per step, so a single step beyond it proves little; a majority of
steps is much harder for noise alone to reach. The trace says where the change first shows: the first
divergence of CANDIDATE from BASE_A, against the first divergence between the baselines.

Exit codes: 0 identical or noise, 1 real, 2 when a run cannot be compared with BASE_A record by record (other
world size, rung or windows): metrics of such runs say nothing about the change.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from detrace.cli._args import ArgumentParser
from detrace.compare import diff
from detrace.errors import IncomparableError, TraceError, UsageError
from detrace.report.html import metric_rank, metric_series
from detrace.tracefile import open_run

SCHEMA = "detrace.compare/1"
DEFAULT_FACTOR = 10.0


@dataclass(frozen=True, kw_only=True)
class MetricComparison:
    """One metric of the candidate against the baselines."""

    name: str
    steps: list[dict[str, Any]]
    """Per step: a, b, candidate, noise, effect, beyond."""
    verdict: str
    """real | noise | identical."""
    first_beyond: int | None
    """The first step where the candidate is beyond the noise."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "first_beyond": self.first_beyond, "steps": self.steps}


def compare_metric(name: str, a: dict[int, float], b: dict[int, float], c: dict[int, float],
                   factor: float) -> MetricComparison:
    """The step-by-step comparison of one metric (see the module docstring for the rule)."""
    rows = []
    envelope = 0.0
    for step in sorted(a.keys() & b.keys() & c.keys()):
        envelope = max(envelope, abs(a[step] - b[step]))
        effect = abs(c[step] - (a[step] + b[step]) / 2)
        differs = c[step] != a[step] or b[step] != a[step]
        beyond = c[step] != a[step] and (math.isnan(effect) or effect > factor * envelope)
        rows.append({"step": step, "a": a[step], "b": b[step], "candidate": c[step], "noise": envelope,
                     "effect": effect, "differs": differs, "beyond": beyond})
    differing = [r for r in rows if r["differs"]]
    beyond = [r for r in differing if r["beyond"]]
    if not any(r["candidate"] != r["a"] for r in rows):
        verdict = "identical"
    elif 2 * len(beyond) > len(differing):
        verdict = "real"
    else:
        verdict = "noise"
    return MetricComparison(name=name, steps=rows, verdict=verdict,
                            first_beyond=beyond[0]["step"] if beyond else None)


def _describe(first: dict[str, Any] | None) -> str:
    if first is None:
        return "identical"
    return (f"step {first['step']}, rank {first['rank']}: {first['phase']} {first['name']}"
            + (f" in {first['module']}" if first.get("module") else ""))


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
    if not args.factor > 0:
        raise UsageError(f"--factor must be positive, not {args.factor}")
    runs = (args.base_a, args.base_b, args.candidate)
    for run in runs:
        open_run(run)
    rank = metric_rank(args.base_a) if args.rank is None else args.rank
    if rank is None:
        raise TraceError(f"{args.base_a} recorded no metrics to compare (trace it at rung metrics or above)")
    series = []
    for run in runs:
        if rank not in open_run(run).ranks:
            raise TraceError(f"{run} holds no trace of rank {rank}")
        series.append(metric_series(run, rank))
    names = sorted(series[0].keys() & series[1].keys() & series[2].keys())
    if not names:
        raise TraceError(f"the three runs share no metric on rank {rank}")
    diffs = {"baselines": (args.base_b, diff(args.base_a, args.base_b)),
             "candidate": (args.candidate, diff(args.base_a, args.candidate))}
    for other, result in diffs.values():  # metrics of runs that cannot be compared record by record mean nothing
        if result.verdict == "incomparable":
            raise IncomparableError(f"{other} cannot be compared with {args.base_a}: {result.reason}")
    trace = {what: result.first.to_json() if result.first else None for what, (_, result) in diffs.items()}
    metrics = [compare_metric(n, *(s[n] for s in series), args.factor) for n in names]
    verdicts = {m.verdict for m in metrics}
    verdict = "real" if "real" in verdicts else "noise" if "noise" in verdicts else "identical"
    payload = {"schema": SCHEMA, "verdict": verdict, "rank": rank, "factor": args.factor,
               "metrics": [m.to_json() for m in metrics], "trace": trace}
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        _render(payload, metrics, Console(highlight=False))
    return 1 if verdict == "real" else 0


def _render(payload: dict[str, Any], metrics: list[MetricComparison], console: Console) -> None:
    for metric in metrics:
        table = Table("step", "A", "B", "candidate", "noise |A-B| so far", "effect |C-mid|", "",
                      title=f"{metric.name}: {metric.verdict}", title_justify="left")
        for row in metric.steps:
            mark = "[red]beyond[/]" if row["beyond"] else ("within" if row["differs"] else "")
            table.add_row(str(row["step"]), f"{row['a']:.9g}", f"{row['b']:.9g}", f"{row['candidate']:.9g}",
                          f"{row['noise']:.3g}", f"{row['effect']:.3g}", mark)
        console.print(table)
    verdict = payload["verdict"]
    text = {"real": "the change's effect is real: beyond the baselines' run-to-run variation",
            "noise": "the change's effect is within the baselines' run-to-run variation (noise)",
            "identical": "the candidate's metrics are bit-identical to the baseline"}[verdict]
    console.print(f"[bold]{verdict}[/]: {text} (rank {payload['rank']}, factor {payload['factor']:g})")
    console.print(f"  trace: baselines first differ at {_describe(payload['trace']['baselines'])}")
    console.print(f"         candidate first differs from BASE_A at {_describe(payload['trace']['candidate'])}")
