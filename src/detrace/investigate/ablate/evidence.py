"""What ablate reads back from its runs and keeps: each run's `Outcome` (with where it departs from the baseline),
the bisection's `Samples`, the state's `Split`, and the `AblateResult` that ablate.json holds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.analyze.metrics import metric_series, same_bits
from detrace.analyze.pairs import same_over
from detrace.investigate.ablate.config import AblateConfig, Variant
from detrace.tracefile import open_run, read_rank
from detrace.verdicts import ABLATE, AblateCause, AblateVerdict

SCHEMA = "detrace.ablate/1"


@dataclass(frozen=True, kw_only=True)
class Departure:
    """Where a variant's trace first departs from the baseline's (the diff's first record)."""

    step: int
    phase: str
    module: str | None
    name: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "module": self.module, "name": self.name, "rank": self.rank}

    def where(self) -> str:
        return f"step {self.step}, {self.phase} {self.name}" + (f" in {self.module}" if self.module else "")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One variant's evidence."""

    variant: Variant
    run: Path
    at: int
    """Its step that sees the baseline's S batch: S - shift."""
    value: float | None
    """The metric there (None: the run did not record it)."""
    spiked: bool
    """value > the threshold, or value not finite."""
    departure: Departure | None
    """The first record that differs from the baseline (None: identical, or not compared since it starts
    elsewhere)."""
    series: dict[int, float]
    """Its metric by step."""
    seconds: float
    steps: int
    """Steps it executed."""
    unavailable: str | None = None
    """Why the variant could not run (its run failed: a data control the program refuses, a crash); None when
    it ran. The verdict is given from the others."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        v = self.variant
        return {"name": v.name, "change": v.change, "start": v.start, "env": v.env, "args": list(v.args),
                "run": str(self.run), "at": self.at, "value": self.value, "spiked": self.spiked,
                "unavailable": self.unavailable,
                "effect": None if self.value is None else self.value - baseline,
                "departure": self.departure.to_json() if self.departure else None,
                "seconds": round(self.seconds, 3), "steps": self.steps, "series": _series_json(self.series)}


@dataclass(frozen=True, kw_only=True)
class Samples:
    """The bisection of the batch of S: which of its samples the spike needs."""

    step: int
    """S."""
    indices: tuple[int, ...]
    """The dataset indices of S's batch on the metric's rank, in the order trained (micro-batches one after the
    other); empty when the program recorded none."""
    culprit: int | None
    """The dataset index whose absence alone removes the spike; None when the bisection named none."""
    replays: tuple[Outcome, ...]
    """Its replays, each dropping some of the samples (DETRACE_DROP_SAMPLES), in the order run."""
    note: str
    """What it found, or why it stopped, as a clause."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        return {"step": self.step, "indices": list(self.indices), "culprit": self.culprit,
                "position": None if self.culprit is None else self.indices.index(self.culprit),
                "note": self.note, "replays": [o.to_json(baseline) for o in self.replays]}


@dataclass(frozen=True, kw_only=True)
class Split:
    """The split of a state verdict: which part of the state at C carries the spike."""

    earlier: int
    """C': completed steps of the checkpoint the parts come from (0: there was none, and nothing ran)."""
    replays: tuple[Outcome, ...]
    """One replay from C per part (`RESTORE_PARTS`), that part from C', in the order run."""
    parts: tuple[str, ...]
    """The parts whose version at C' removes the spike."""
    note: str
    """What it found, or why it could not run, as a clause."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        return {"earlier": self.earlier, "parts": list(self.parts), "note": self.note,
                "replays": [o.to_json(baseline) for o in self.replays]}


def batch_samples(run: Path, rank: int, step: int) -> tuple[int, ...]:
    """The dataset indices of the samples one rank trained on at `step`, as its trace's batch rung recorded them
    (the "samples" records, micro-batch after micro-batch); empty when it recorded none."""
    table = read_rank(run, rank).table.select(["step", "phase", "name", "extra"]).to_pylist()
    found: list[int] = []
    for row in table:
        if row["step"] == step and row["phase"] == "data" and row["name"] == "samples" and row["extra"]:
            found += json.loads(row["extra"])["samples"]
    return tuple(found)


def _series_json(series: Mapping[int, float]) -> dict[str, float]:
    return {str(step): value for step, value in sorted(series.items())}


@dataclass(frozen=True, kw_only=True)
class AblateResult:
    """What `detrace ablate` found."""

    verdict: AblateVerdict
    cause: AblateCause | None
    summary: str
    """One sentence."""
    config: AblateConfig
    checkpoint: int
    """C."""
    threshold: float | None
    original: dict[int, float]
    """The original run's metric by step."""
    baseline: Outcome | None
    outcomes: tuple[Outcome, ...] = ()
    """The variants, ranked by their effect on the spike (the largest fall of the metric at S first)."""
    samples: Samples | None = None
    """The bisection of S's batch (a data or both verdict)."""
    split: Split | None = None
    """Which part of the state carries the spike (a state verdict)."""

    @property
    def exit_code(self) -> int:
        return ABLATE[self.verdict]

    @property
    def runs(self) -> list[Outcome]:
        """Every run ablate made."""
        return (([self.baseline] if self.baseline else []) + list(self.outcomes)
                + (list(self.samples.replays) if self.samples else [])
                + (list(self.split.replays) if self.split else []))

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.runs)

    @property
    def steps(self) -> int:
        return sum(o.steps for o in self.runs)

    def to_json(self) -> dict[str, Any]:
        base = self.baseline
        value = base.value if base and base.value is not None else float("nan")
        return {"schema": SCHEMA, "verdict": self.verdict, "exit_code": self.exit_code, "cause": self.cause,
                "summary": self.summary, "step": self.config.step, "metric": self.config.metric,
                "run": str(self.config.run), "command": list(self.config.command), "checkpoint": self.checkpoint,
                "threshold": self.threshold, "k": self.config.rule.k, "window": self.config.rule.window,
                "original": self.original.get(self.config.step),
                "baseline": None if base is None else {"run": str(base.run), "value": base.value,
                                                       "spiked": base.spiked, "seconds": round(base.seconds, 3),
                                                       "steps": base.steps, "series": _series_json(base.series)},
                "original_series": _series_json({t: v for t, v in self.original.items()
                                                 if abs(t - self.config.step) <= 2 * self.config.rule.window}),
                "variants": [o.to_json(value) for o in self.outcomes],
                "samples": None if self.samples is None else self.samples.to_json(value),
                "split": None if self.split is None else self.split.to_json(value),
                "cost": {"runs": len(self.runs), "steps": self.steps, "seconds": round(self.seconds, 3)}}


def reproduces(original: Path, baseline: Path, first: int, last: int) -> str | None:
    """Whether the baseline has the original run's records bit for bit over steps first..last: None when it does,
    else where it first differs. The baseline records the metrics and semantic rungs: an original traced at the
    semantic rung is held to every record, any other to its metrics."""
    info = open_run(original)
    if info.header.rung == "semantic":
        return same_over(original, baseline, first, last)
    differences = []
    for rank in info.ranks:
        theirs, ours = metric_series(original, rank), metric_series(baseline, rank)
        for name, values in sorted(theirs.items()):
            for step in range(first, last + 1):
                if step in values and not same_bits(ours.get(name, {}).get(step), values[step]):
                    differences.append((step, rank, name, ours.get(name, {}).get(step), values[step]))
    if not differences:
        return None
    step, rank, name, got, want = min(differences, key=lambda d: d[:3])  # the earliest step first
    return f"rank {rank}, step {step}: {name} {got!r} against {want!r}"
