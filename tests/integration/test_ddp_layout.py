"""A DDP bucket layout change is shown as a layout change, with the per-parameter gradients compared, never as a
numeric origin. DDP rebuilds its buckets after a process's first iteration: a resumed process's first step can
reduce other buckets (other parameters, in another order) than the continuous run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from _synthetic import SyntheticRun, rank_table, write_table

from detrace.analyze import diff
from detrace.tracefile import ARROW_SCHEMA

RUN = SyntheticRun(ranks=2, steps=4, ops=4)


def _bucketed(rows: list[dict[str, Any]], *, rebuilt_at: int | None = None,
              grads_differ: bool = False) -> list[dict[str, Any]]:
    """The synthetic all_reduce as a DDP bucket; from `rebuilt_at` on, the bucket holds its parameters in another
    order (other bits in the bucket), and with `grads_differ` the gradients it gives differ too."""
    out = []
    for row in rows:
        row = dict(row)
        rebuilt = rebuilt_at is not None and row["step"] == rebuilt_at
        if row["phase"] == "collective":
            row["extra"] = json.dumps({"ddp_bucket": 0, "params": ["layers.1.w", "layers.0.w"] if rebuilt
                                       else ["layers.0.w", "layers.1.w"]})
            if rebuilt:
                row["digest"] ^= 0xABCDEF
        if rebuilt and grads_differ and row["phase"] == "optimizer":
            row["digest"] ^= 0x123
        out.append(row)
    return out


def _run(out: Path, **change: Any) -> Path:
    for rank in range(RUN.ranks):
        rows = _bucketed(rank_table(RUN, rank).to_pylist(), **change)
        write_table(out, rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=RUN.ranks)
    return out


def test_a_layout_change_with_equal_gradients_is_no_divergence(tmp_path: Path) -> None:
    result = diff(_run(tmp_path / "a"), _run(tmp_path / "b", rebuilt_at=2))
    assert result.verdict == "identical", result.first
    assert ("rank 0, step 2: the DDP bucket layout differs (1 buckets in A, 1 in B; bucket 0 holds [layers.0.w, "
            "layers.1.w] in A and [layers.1.w, layers.0.w] in B): the buckets were not compared, the gradients per "
            "parameter were") in result.notes


def test_gradients_that_differ_after_a_layout_change_are_the_divergence(tmp_path: Path) -> None:
    result = diff(_run(tmp_path / "a"), _run(tmp_path / "b", rebuilt_at=2, grads_differ=True))
    assert result.verdict == "diverged"
    first = result.first
    assert first is not None
    assert (first.step, first.phase, first.role, first.kind) == (2, "optimizer", "grad", "numeric")
    assert first.name != "all_reduce" and not first.origin
    assert any("the DDP bucket layout differs" in note for note in result.notes)


def test_the_same_layout_with_other_bits_is_still_a_numeric_divergence(tmp_path: Path) -> None:
    a = _run(tmp_path / "a")
    tables = []
    for rank in range(RUN.ranks):
        rows = _bucketed(rank_table(RUN, rank).to_pylist())
        for row in rows:
            if rank == 1 and row["phase"] == "collective" and row["step"] == 2 and row["role"] == "input":
                row["digest"] ^= 1
        tables.append(rows)
    for rank, rows in enumerate(tables):
        write_table(tmp_path / "b", rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=RUN.ranks)
    result = diff(a, tmp_path / "b")
    assert result.verdict == "diverged" and not any("layout" in note for note in result.notes)
    first = result.first
    assert first is not None and (first.step, first.name, first.rank) == (2, "all_reduce", 1)
