"""What makes two records "the same record" and "the same bits", vectorised over aligned batches.

Identity (schema.py): (step, phase, module, name, occurrence, role, index), plus the rung. Content: shape, dtype,
numel, digest, chunk digests and the exact metric value. A digest, chunk list or value that one run did not
take (null: the tensor was above --max-numel) is not a difference: there is nothing to compare.

A call's records share `event`; its roles say which side of the call a record is on. A divergent record on the
output side of a call whose input-side records all matched is an *origin*: that call made the difference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze.diff_result import scope_label

IDENTITY = ("step", "rung", "phase", "module", "name", "occurrence", "role", "index")
CONTENT = ("shape", "dtype", "numel", "digest", "chunks", "value")
COMPARED = IDENTITY + CONTENT
"""Columns two aligned runs must agree on. seq, event and collectives are left out on purpose: after a
structural divergence they are shifted in one run while the records themselves still match."""

INPUT_ROLES = frozenset({"input", "grad_output", "grad"})
"""Roles on the way into a call (a module's backward receives grad_output; the optimizer receives grads)."""
OUTPUT_ROLES = frozenset({"output", "mutated", "grad_input", "param", "state", "buffer", "component", "metric"})
COMMUNICATION = frozenset({"collective", "p2p"})


def same(a: pa.RecordBatch, b: pa.RecordBatch) -> bool:
    """Fast path: every compared column of two equally long slices is equal (C++ comparisons, no masks)."""
    return all(a.column(name).equals(b.column(name)) for name in COMPARED)


def _strings_equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    eq = pc.fill_null(pc.equal(a, b), False)
    if a.null_count or b.null_count:
        eq = pc.or_(eq, pc.and_(a.is_null(), b.is_null()))
    return eq.to_numpy(zero_copy_only=False)


def _known(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Rows where both runs recorded a value."""
    return pc.and_(a.is_valid(), b.is_valid()).to_numpy(zero_copy_only=False)


def _lists_equal(a: pa.ListArray, b: pa.ListArray) -> np.ndarray:
    """Row-wise equality of two list columns (offset-aware, no Python loop). Null rows compare equal."""
    off_a, off_b = np.asarray(a.offsets), np.asarray(b.offsets)
    len_a, len_b = np.diff(off_a), np.diff(off_b)
    equal = len_a == len_b
    rows = np.flatnonzero(equal & (len_a > 0))
    if rows.size:
        lengths = len_a[rows]
        owner = np.repeat(np.arange(rows.size), lengths)
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        values_a = a.values.to_numpy(zero_copy_only=False)
        values_b = b.values.to_numpy(zero_copy_only=False)
        differs = values_a[off_a[rows][owner] + within] != values_b[off_b[rows][owner] + within]
        equal[rows] = np.bincount(owner, weights=differs, minlength=rows.size) == 0
    if a.null_count or b.null_count:
        equal |= ~_known(a, b)
    return equal


def _bits_equal(a: pa.Array, b: pa.Array, *, as_float: bool) -> np.ndarray:
    """Equality of digests (uint64) or metric values compared bit for bit (so -0.0 != 0.0 and NaN == NaN)."""
    fill = 0.0 if as_float else 0
    va = pc.fill_null(a, fill).to_numpy(zero_copy_only=False)
    vb = pc.fill_null(b, fill).to_numpy(zero_copy_only=False)
    if as_float:
        va, vb = va.view(np.uint64), vb.view(np.uint64)
    equal = va == vb
    if a.null_count or b.null_count:
        equal |= ~_known(a, b)
    return equal


def identity_mask(a: pa.RecordBatch, b: pa.RecordBatch) -> np.ndarray:
    """Row-wise: the two records have the same identity."""
    equal = np.ones(a.num_rows, dtype=bool)
    for name in IDENTITY:
        col_a, col_b = a.column(name), b.column(name)
        if pa.types.is_string(col_a.type):
            equal &= _strings_equal(col_a, col_b)
        else:
            equal &= pc.equal(col_a, col_b).to_numpy(zero_copy_only=False)
    return equal


def content_mask(a: pa.RecordBatch, b: pa.RecordBatch) -> np.ndarray:
    """Row-wise: the two records carry the same bits (meaningful where the identities match)."""
    equal = _lists_equal(a.column("shape"), b.column("shape"))
    equal &= _strings_equal(a.column("dtype"), b.column("dtype"))
    equal &= pc.equal(a.column("numel"), b.column("numel")).to_numpy(zero_copy_only=False)
    equal &= _bits_equal(a.column("digest"), b.column("digest"), as_float=False)
    equal &= _bits_equal(a.column("value"), b.column("value"), as_float=True)
    equal &= _lists_equal(a.column("chunks"), b.column("chunks"))
    return equal


def label(row: dict[str, Any]) -> str:
    """A record's identity in one line: "backward layers.1.moe aten.index_put_.default#0 output[0]"."""
    scope = f" {scope_label(row.get('module'))}" if row.get("module") is not None else ""
    return f"{row['phase']}{scope} {row['name']}#{row['occurrence']} {row['role']}[{row['index']}]"


def tensor_label(row: dict[str, Any]) -> str:
    """"float32[4, 8]"."""
    return f"{row['dtype']}{list(row['shape'])}"


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What differs between two records of the same identity, for the report: fields and differing chunks."""
    found: dict[str, Any] = {}
    for name in ("shape", "dtype", "numel"):
        if a[name] != b[name]:
            found[name] = [a[name], b[name]]
    if a["digest"] is not None and b["digest"] is not None and a["digest"] != b["digest"]:
        found["digest"] = [f"{a['digest']:016x}", f"{b['digest']:016x}"]
    if a["value"] is not None and b["value"] is not None:
        bits = np.array([a["value"], b["value"]], dtype=np.float64).view(np.uint64)
        if bits[0] != bits[1]:
            found["value"] = [a["value"], b["value"]]
    chunks_a, chunks_b = a["chunks"], b["chunks"]
    if chunks_a is not None and chunks_b is not None and chunks_a != chunks_b:
        if len(chunks_a) == len(chunks_b):
            found["chunks"] = [i for i, (x, y) in enumerate(zip(chunks_a, chunks_b, strict=True)) if x != y]
            found["chunks_total"] = len(chunks_a)
        else:
            found["chunks_count"] = [len(chunks_a), len(chunks_b)]
    return found
