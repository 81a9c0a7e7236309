"""The noise test behind `detrace compare BASE_A BASE_B CANDIDATE`: is a change's effect real, or run-to-run noise?

(Not to be confused with the package `detrace.analyze`, the diff engine, which this module uses.)

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

A run that cannot be compared with BASE_A record by record (other world size, rung or windows), or that does not
cover the same steps (it stopped earlier or ran on: every step is accounted for), is refused
(`IncomparableError`): metrics of such runs say nothing about the change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.analyze import DiffResult, Divergence, diff
from detrace.analyze.metrics import metric_rank, metric_series
from detrace.errors import IncomparableError, TraceError, UsageError
from detrace.tracefile import open_run
from detrace.verdicts import NOISE, NoiseVerdict

SCHEMA = "detrace.compare/1"
DEFAULT_FACTOR = 10.0
"""How many times the baselines' spread an effect must exceed to count as beyond it."""


@dataclass(frozen=True, kw_only=True)
class MetricComparison:
    """One metric of the candidate against the baselines."""

    name: str
    """The metric's name."""
    steps: list[dict[str, Any]]
    """Per step: step, a, b, candidate, noise, effect, differs, beyond."""
    verdict: NoiseVerdict
    """real (beyond the noise at most of the steps where a run differs) | noise | identical (to BASE_A)."""
    first_beyond: int | None
    """The first step where the candidate is beyond the noise."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "first_beyond": self.first_beyond, "steps": self.steps}


@dataclass(frozen=True, kw_only=True)
class NoiseResult:
    """The answer of `noise_test`: the `detrace.compare/1` object."""

    verdict: NoiseVerdict
    """real if any metric's effect is real, else noise if any metric is within the noise, else identical."""
    rank: int
    """The rank whose metrics were compared."""
    factor: float
    """How many times the baselines' spread an effect had to exceed."""
    metrics: list[MetricComparison]
    """One per metric the three runs share, by name."""
    baselines: Divergence | None
    """Where the two baselines' traces first differ (None: identical)."""
    candidate: Divergence | None
    """Where the candidate's trace first differs from BASE_A's (None: identical)."""

    @property
    def exit_code(self) -> int:
        return NOISE[self.verdict]

    def to_json(self) -> dict[str, Any]:
        trace = {"baselines": None if self.baselines is None else self.baselines.to_json(),
                 "candidate": None if self.candidate is None else self.candidate.to_json()}
        return {"schema": SCHEMA, "verdict": self.verdict, "rank": self.rank, "factor": self.factor,
                "metrics": [m.to_json() for m in self.metrics], "trace": trace}


def compare_metric(name: str, a: dict[int, float], b: dict[int, float], c: dict[int, float],
                   factor: float) -> MetricComparison:
    """The step-by-step comparison of one metric (see the module docstring for the rule)."""
    rows: list[dict[str, Any]] = []
    envelope = 0.0
    for step in sorted(a.keys() & b.keys() & c.keys()):
        envelope = max(envelope, abs(a[step] - b[step]))
        effect = abs(c[step] - (a[step] + b[step]) / 2)
        differs = c[step] != a[step] or b[step] != a[step]
        rows.append({"step": step, "a": a[step], "b": b[step], "candidate": c[step], "noise": envelope,
                     "effect": effect, "differs": differs,
                     "beyond": c[step] != a[step] and (math.isnan(effect) or effect > factor * envelope)})
    differing = [r for r in rows if r["differs"]]
    beyond = [r for r in differing if r["beyond"]]
    verdict: NoiseVerdict
    if not any(r["candidate"] != r["a"] for r in rows):
        verdict = "identical"
    elif 2 * len(beyond) > len(differing):
        verdict = "real"
    else:
        verdict = "noise"
    return MetricComparison(name=name, steps=rows, verdict=verdict,
                            first_beyond=beyond[0]["step"] if beyond else None)


def _stop(result: DiffResult) -> str | None:
    """The sentence of a run that stopped before the other's last step, on any rank (`Divergence.stop`)."""
    return next((r.first.stop for r in result.ranks if r.first is not None and r.first.stop), None)


def noise_test(base_a: str | Path, base_b: str | Path, candidate: str | Path, *, factor: float = DEFAULT_FACTOR,
               rank: int | None = None) -> NoiseResult:
    """Set `candidate` against the variation between `base_a` and `base_b` (two runs of the unchanged program),
    on the metrics of `rank` (default: the lowest rank that recorded metrics)."""
    if not 0 < factor < math.inf:  # an infinite factor would call any effect noise, even over identical baselines
        raise UsageError(f"--factor must be a positive finite number, not {factor}")
    runs = (Path(base_a), Path(base_b), Path(candidate))
    opened = [open_run(run) for run in runs]
    rank = metric_rank(runs[0]) if rank is None else rank
    if rank is None:
        raise TraceError(f"{base_a} recorded no metrics to compare (trace it at rung metrics or above)")
    series = []
    for run, info in zip(runs, opened, strict=True):
        if rank not in info.ranks:
            raise TraceError(f"{run} holds no trace of rank {rank}")
        series.append(metric_series(run, rank))
    names = sorted(series[0].keys() & series[1].keys() & series[2].keys())
    if not names:
        raise TraceError(f"the three runs share no metric on rank {rank}")
    diffs = [diff(runs[0], other) for other in runs[1:]]
    for other, result in zip(runs[1:], diffs, strict=True):
        # metrics of runs that cannot be compared record by record mean nothing
        if result.verdict == "incomparable":
            raise IncomparableError(f"{other} cannot be compared with {base_a}: {result.reason}")
        stop = _stop(result)
        if stop is not None:
            # Metrics over the common steps alone would call a run that stopped early "identical".
            raise IncomparableError(f"{other} and {base_a} (A) do not cover the same steps: {stop}; compare runs "
                                    "that train the same steps")
    metrics = [compare_metric(n, series[0][n], series[1][n], series[2][n], factor) for n in names]
    verdicts = {m.verdict for m in metrics}
    verdict: NoiseVerdict = "real" if "real" in verdicts else "noise" if "noise" in verdicts else "identical"
    return NoiseResult(verdict=verdict, rank=rank, factor=factor, metrics=metrics, baselines=diffs[0].first,
                       candidate=diffs[1].first)
