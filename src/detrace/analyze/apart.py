"""Records compared apart from the training: checkpoint I/O, a framework's bookkeeping collectives, evaluations.

A resumed process loads a checkpoint and a continuous one may save one; a framework gathers its logged loss
where its own schedule says, which differs between a continuous and a resumed run (HF logs a resumed run's
first step apart); a continuous run evaluates at the step where a resumed one starts. Those records (phases
"checkpoint", "bookkeeping" and "evaluation", see detrace.tracefile.schema) are taken out of the positional
alignment, so they never shift it, and matched by identity instead: the records both runs hold are compared bit
for bit, and what only one run holds is counted. What only one run holds is never a divergence, and neither is a
differing checkpoint or bookkeeping record: the training's own records (data, loss, gradients, parameters, buffers,
optimizer state) decide that. An evaluation that both runs ran and that differs is one (`Apart.evaluation`): an
evaluation that is itself nondeterministic must be found. So is a record of the final state that differs
(`Apart.final`): the model changed after the last step. The result says what was compared apart, in a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze.classify import CONTENT, IDENTITY, INPUT_ROLES, OUTPUT_ROLES, label

APART_PHASES = ("checkpoint", "bookkeeping", "evaluation", "final")
"""Phases compared apart, by identity. "final": the state a run ends with, recorded as its trace closes (after its
last step, docs/tracing.md); it is compared only when both runs ended at the same step (a run that stopped early is
a divergence of its own), and a difference there is a divergence after the last step (`Apart.final`)."""
_WHAT = {"checkpoint": "checkpoint I/O", "bookkeeping": "framework bookkeeping collectives",
         "evaluation": "evaluations", "final": "the final state"}
MAX_APART = 200_000
"""Records per side kept for the comparison; beyond it the rest is counted only."""
_APART_SET = pa.array(APART_PHASES)


def split(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
    """(the training's records, the records compared apart or None) of one batch, each in execution order."""
    apart = pc.is_in(batch.column("phase"), value_set=_APART_SET)
    if not pc.any(apart).as_py():
        return batch, None
    return batch.filter(pc.invert(apart)), batch.filter(apart)


@dataclass(kw_only=True)
class Count:
    """What the records of one phase compared apart showed."""

    in_a: int = 0
    """Records of the phase in run A (on the compared steps)."""
    in_b: int = 0
    """The same in run B."""
    both: int = 0
    """Records of the same identity in both runs."""
    differ: int = 0
    """Of those, records whose bits differ."""
    first_differ: str | None = None
    """"step 3 bookkeeping all_gather#0 output[0]" of the first differing record (execution order of A)."""

    def add(self, other: Count) -> None:
        self.in_a, self.in_b = self.in_a + other.in_a, self.in_b + other.in_b
        self.both, self.differ = self.both + other.both, self.differ + other.differ
        self.first_differ = self.first_differ or other.first_differ


@dataclass(kw_only=True)
class Apart:
    """What the records compared apart of one rank showed."""

    phases: dict[str, Count] = field(default_factory=dict)
    """Per phase seen (APART_PHASES), its counts."""
    evaluation: tuple[dict[str, Any], dict[str, Any], bool] | None = None
    """(row of A, row of B, origin) of the first evaluation record that differs, in A's execution order: the
    divergence it is. `origin`: an output of a call whose inputs all matched."""
    final: tuple[dict[str, Any], dict[str, Any]] | None = None
    """(row of A, row of B) of the first record of the final state (phase "final") whose bits differ: the state
    changed after the last step."""

    def of(self, phase: str) -> Count:
        return self.phases.setdefault(phase, Count())


_ROW = ("seq", "event", "collectives", "group", "group_seq", "peer", "extra")
"""Columns kept beside identity and content: a differing evaluation is reported as a divergence with them."""


def _rows(batches: list[pa.RecordBatch], start: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch in batches:
        kept = batch.filter(pc.greater_equal(batch.column("step"), start)).select([*_ROW, *IDENTITY, *CONTENT])
        rows += kept.to_pylist()
        if len(rows) >= MAX_APART:
            return rows[:MAX_APART]
    return rows


def compare(a: list[pa.RecordBatch], b: list[pa.RecordBatch], *, start: int) -> Apart | None:
    """Match the records set aside by both runs by identity and compare their bits; None when there were none."""
    rows_a, rows_b = _rows(a, start), _rows(b, start)
    if not rows_a and not rows_b:
        return None
    found = Apart()
    for row in rows_a:
        found.of(row["phase"]).in_a += 1
    for row in rows_b:
        found.of(row["phase"]).in_b += 1
    by_identity = {tuple(row[name] for name in IDENTITY): row for row in rows_b}
    differing: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for row in rows_a:
        other = by_identity.get(tuple(row[name] for name in IDENTITY))
        if other is None:
            continue
        count = found.of(row["phase"])
        count.both += 1
        if any(row[name] != other[name] for name in CONTENT):
            count.differ += 1
            if count.first_differ is None:
                count.first_differ = f"step {row['step']} {label(row)}"
            if row["phase"] == "evaluation":
                differing.append((row, other))
            elif row["phase"] == "final" and found.final is None:
                found.final = (row, other)
    found.evaluation = _evaluation(differing)
    return found


def _evaluation(differing: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any],
                                                                                  bool] | None:
    """The first differing evaluation record (A's order) and whether it is an origin; prefer, as the divergence
    named, the first output whose call's inputs all matched (the call that made the difference)."""
    if not differing:
        return None
    fed = {row["event"] for row, _ in differing if row["role"] in INPUT_ROLES}
    for row, other in differing:
        if row["role"] in OUTPUT_ROLES and row["role"] != "metric" and row["event"] not in fed:
            return row, other, True
    return differing[0][0], differing[0][1], False


def note(found: dict[int, Apart]) -> str | None:
    """One sentence for the result's notes about every rank's records compared apart, phase by phase, or None."""
    total: dict[str, Count] = {}
    for one in found.values():
        for phase, count in one.phases.items():
            total.setdefault(phase, Count()).add(count)
    if not total.keys() - {"final"}:
        return None
    parts = []
    # The final state is not noted: both runs end with one, and where it differs, that is the divergence itself.
    for phase in (p for p in APART_PHASES if p in total and p != "final"):
        count = total[phase]
        text = f"{_WHAT[phase]}: {count.in_a} records in A, {count.in_b} in B, {count.both} in both"
        if count.differ:
            text += f", of which {count.differ} differ (first: {count.first_differ})"
        elif count.both:
            text += ", every bit equal"
        parts.append(text)
    return "compared apart from the training, by identity: " + "; ".join(parts)
