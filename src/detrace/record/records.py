"""The tracer's records: what one observed call and one fingerprinted tensor are, which leaves of a value are
recorded, and the Arrow batch a list of buffered records becomes.

A record is kept in memory as a tuple (`Record`) until its batch is written; `to_batch` turns a list of them into
columns of the trace format (detrace.tracefile.schema).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from detrace._compat import pytree
from detrace.tracefile.columns import column
from detrace.tracefile.schema import ARROW_SCHEMA, COLUMN_NAMES


@dataclass(slots=True, kw_only=True)
class Snapshot:
    """The fingerprint of one tensor (or component object) taken at a moment of a call; the tensor itself is not
    kept. A small tensor's bits are copied at that moment and hashed with the rest of its batch, so `digest` is
    filled in later (`SnapshotMemo.resolve`, at the latest when its records are written)."""

    shape: tuple[int, ...]
    """The tensor's shape (a component object's logical shape)."""
    dtype: str
    """torch dtype name without "torch.", or a component object's format name."""
    numel: int
    """Number of elements."""
    digest: int | None = None
    """The fingerprint; None until resolved, and for good above --max-numel or when it cannot be taken."""
    chunks: tuple[int, ...] | None = None
    """Chunk-wise digests, when taken."""
    components: tuple[tuple[str, Snapshot], ...] = ()
    """A quantized tensor's components (`__detrace_components__`): (name, snapshot) in the object's order."""


@dataclass(slots=True)
class Call:
    """One observed call (op, module, collective, optimizer step...): its records share `event`."""

    rung: str
    phase: str
    name: str
    module: str | None
    occurrence: int
    step: int
    group: str | None = None
    group_seq: int | None = None
    peer: int | None = None
    extra: str | None = None
    event: int | None = None
    components: int = 0
    """Component records added so far (their index)."""


Record = tuple[int, Call, str, int, Snapshot | None, Any, int, str | None]
"""A buffered record: (seq, call, role, index, snapshot, metric value, collectives, extra)."""


def has_components(value: object) -> bool:
    """Whether `value` is a quantized tensor or other object fingerprinted as its components."""
    return getattr(type(value), "__detrace_components__", None) is not None


def recorded_leaves(value: Any, *, holes: bool = False) -> list[Any]:
    """The tensors and component objects in a (nested) value, in pytree order: what a record is made of.
    `holes`: None leaves stay, as None, so that indices follow the value's positions."""
    return [leaf for leaf in pytree.tree_leaves(value)
            if isinstance(leaf, torch.Tensor) or (holes and leaf is None) or has_components(leaf)]


def _storages(tensors: list[Any]) -> set[int]:
    """The data pointers of the storages of `tensors` (0 and those it cannot tell left out: meta tensors,
    wrappers)."""
    pointers = set()
    for tensor in tensors:
        try:
            pointers.add(tensor.untyped_storage().data_ptr())
        except Exception:  # a tensor without a plain storage shares none that we can see
            continue
    return pointers - {0}


def shares_data(tensors: list[Any], others: list[Any]) -> bool:
    """Whether one of `tensors` is one of `others`, or a view of the same storage (`x` and `x[:, :-1]`)."""
    if any(tensor is other for tensor in tensors for other in others):
        return True
    return bool(_storages(tensors) & _storages(others))


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: a DTensor's local shard (never gathered: no collective). A sharded DTensor is
    recorded as its part of the global fingerprint instead where it can be (`SnapshotMemo._part`)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor).__name__ == "DTensor" else tensor


def to_batch(records: list[Record]) -> pa.RecordBatch:
    """The Arrow batch of buffered records (columns in schema order; metric tensors read in one transfer). Run it
    as the tracer's own code (`Tracer.own`): reading the metric tensors runs tensor ops."""
    seq, calls, roles, indices, snaps, values, collectives, extras = (
        list(column) for column in zip(*records, strict=True))
    tensors = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
    if tensors:
        exact = torch.stack([values[i].detach().reshape(()).to("cpu", torch.float64) for i in tensors])
        for i, value in zip(tensors, exact.tolist(), strict=True):
            values[i] = value
    columns = {
        "seq": seq, "step": [c.step for c in calls], "rung": [c.rung for c in calls],
        "phase": [c.phase for c in calls], "module": [c.module for c in calls], "name": [c.name for c in calls],
        "occurrence": [c.occurrence for c in calls], "event": [c.event for c in calls], "role": roles,
        "index": indices, "shape": [s.shape for s in snaps], "dtype": [s.dtype for s in snaps],
        "numel": [s.numel for s in snaps], "digest": [s.digest for s in snaps],
        "chunks": [s.chunks for s in snaps], "value": values, "collectives": collectives,
        "group": [c.group for c in calls], "group_seq": [c.group_seq for c in calls],
        "peer": [c.peer for c in calls], "extra": extras,
    }
    return pa.record_batch([column(columns[name], ARROW_SCHEMA.field(name).type) for name in COLUMN_NAMES],
                           schema=ARROW_SCHEMA)
