"""Records compared apart from the training: checkpoint I/O and a framework's bookkeeping collectives.

A resumed process loads a checkpoint and a continuous one may save one; a framework gathers its logged loss
where its own schedule says, which differs between a continuous and a resumed run (HF logs a resumed run's
first step apart). Those records (phases "checkpoint" and "bookkeeping", see detrace.tracefile.schema) are taken
out of the positional alignment, so they never shift it, and matched by identity instead: the records both runs
hold are compared bit for bit, and what only one run holds is counted. None of it makes a run "diverged": the
training's own records (data, loss, gradients, parameters, buffers, optimizer state) decide that. The result
says what was found, in a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze.classify import CONTENT, IDENTITY, label

APART_PHASES = ("checkpoint", "bookkeeping")
"""Phases compared apart, by identity."""
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
class Apart:
    """What the records compared apart of one rank showed."""

    in_a: int = 0
    """Records compared apart in run A (on the compared steps)."""
    in_b: int = 0
    """The same in run B."""
    both: int = 0
    """Records of the same identity in both runs."""
    differ: int = 0
    """Of those, records whose bits differ."""
    first_differ: str | None = None
    """"step 3 bookkeeping all_gather#0 output[0]" of the first differing record (execution order of A)."""
    phases: set[str] = field(default_factory=set)
    """The phases seen."""


def _rows(batches: list[pa.RecordBatch], start: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch in batches:
        kept = batch.filter(pc.greater_equal(batch.column("step"), start)).select([*IDENTITY, *CONTENT])
        rows += kept.to_pylist()
        if len(rows) >= MAX_APART:
            return rows[:MAX_APART]
    return rows


def compare(a: list[pa.RecordBatch], b: list[pa.RecordBatch], *, start: int) -> Apart | None:
    """Match the records set aside by both runs by identity and compare their bits; None when there were none."""
    rows_a, rows_b = _rows(a, start), _rows(b, start)
    if not rows_a and not rows_b:
        return None
    found = Apart(in_a=len(rows_a), in_b=len(rows_b), phases={row["phase"] for row in rows_a + rows_b})
    by_identity = {tuple(row[name] for name in IDENTITY): row for row in rows_b}
    for row in rows_a:
        other = by_identity.get(tuple(row[name] for name in IDENTITY))
        if other is None:
            continue
        found.both += 1
        if any(row[name] != other[name] for name in CONTENT):
            found.differ += 1
            if found.first_differ is None:
                found.first_differ = f"step {row['step']} {label(row)}"
    return found


def note(found: dict[int, Apart]) -> str | None:
    """One sentence for the result's notes about every rank's records compared apart, or None."""
    if not found:
        return None
    total = Apart()
    for one in found.values():
        total.in_a, total.in_b = total.in_a + one.in_a, total.in_b + one.in_b
        total.both, total.differ = total.both + one.both, total.differ + one.differ
        total.phases |= one.phases
        total.first_differ = total.first_differ or one.first_differ
    what = " and ".join({"checkpoint": "checkpoint I/O", "bookkeeping": "framework bookkeeping collectives"}[p]
                        for p in APART_PHASES if p in total.phases)
    text = (f"{what} compared apart from the training, by identity: {total.in_a} records in A, {total.in_b} in B, "
            f"{total.both} in both")
    if total.differ:
        return text + f", of which {total.differ} differ (first: {total.first_differ})"
    return text + (", every bit equal" if total.both else "")
