"""The snapshot memo: fingerprints of the tensors a call records, taken once per tensor version and, for small
tensors, deferred to one batch.

`SnapshotMemo.snapshot()` never keeps a tensor of the program's. It reuses the snapshot of a tensor recorded
before and unchanged since (same object, version counter and data pointer), copies small tensors and hashes the
copies together later (one `fingerprint_many` per batch instead of one per call, digests filled in by `resolve`),
and fingerprints the others at once.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from detrace._compat import disable_dispatch, without_data
from detrace.digest.inputs import dtype_name
from detrace.digest.kernels import selected_scheme
from detrace.digest.sharded import is_dtensor, part_of
from detrace.record.records import Snapshot, has_components, local_data

_SEEN_LIMIT = 65536
"""Most snapshots remembered for reuse (a bound on memory, not on correctness)."""
DEFER_BYTES = 1 << 20
"""Tensors up to this size are copied when recorded and hashed in a batch later (one `fingerprint_many` call
for many records instead of one per call); larger ones are hashed at once, in place, without a copy."""
BATCH_TENSORS = 16
"""A snapshot of at least this many tensors (an optimizer step's parameters) is a batch already: hashed at once,
without copies."""
PENDING_BYTES = 64 << 20
"""Most bytes of such copies held at once: past this, the batch is hashed before the next record."""


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place version counter of a plain tensor; None where there is none to trust (inference tensors,
    subclasses), so its snapshot is never reused."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return None
    try:
        return tensor._version
    except RuntimeError:
        return None


def _deferrable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor whose bits a copy can carry to a later batch."""
    return (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter) and tensor.layout == torch.strided \
        and not tensor.is_meta and not tensor.is_quantized and tensor.nbytes <= DEFER_BYTES


def _snapshot_of(fp: Any) -> Snapshot:
    """A Snapshot from a detrace.digest.Fingerprint."""
    return Snapshot(shape=fp.shape, dtype=fp.dtype, numel=fp.numel, digest=fp.digest,
                    chunks=tuple(fp.chunks) if fp.chunks else None,
                    components=tuple((name, _snapshot_of(part)) for name, part in fp.components))


def _packed_values(nested: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor that packs a nested tensor's elements (`values()`, either layout): what is recorded of it,
    so its bits are fingerprinted but not how they split into components. None when torch cannot give it: the
    record then keeps only the dtype (not fingerprinted)."""
    try:
        return nested.values()
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class SnapshotMemo:
    """The fingerprints one tracer takes: reused while a tensor is unchanged, deferred while it is small."""

    def __init__(self, *, max_numel: int | None, own: Callable[[], AbstractContextManager[None]],
                 lock: threading.RLock) -> None:
        self.max_numel = max_numel
        """Tensors above this many elements get no digest (--max-numel; None: no limit)."""
        self._own = own
        """The tracer's `own()`: fingerprints run unseen by the op rung."""
        self._lock = lock
        """The tracer's lock, which also guards its record buffer."""
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int, Snapshot]] = {}
        """id(tensor) -> (the tensor, its version, its data pointer, its snapshot): a tensor recorded as an output
        and again, unchanged, as the next call's input is fingerprinted once. Only writes that bump the version
        counter are seen, so `forget()` clears it wherever something may have written behind it (see there)."""
        self._pending: list[tuple[torch.Tensor, Snapshot]] = []
        self.failed: set[int] = set()
        """id() of the snapshots whose deferred digests could not be taken (`resolve`): their records are dropped
        by the tracer, never written without a digest (which no comparison could tell from an equal one)."""
        self.failure: Exception | None = None
        """Why the last of them could not be taken."""
        """Copies of small recorded tensors and the snapshots whose digests they will give (see DEFER_BYTES)."""
        self._pending_bytes = 0

    def snapshot(self, tensors: Sequence[Any], *, fresh: bool = False, now: bool = False
                 ) -> list[Snapshot | None]:
        """Take the fingerprints of tensors (and component objects) as they are now; None, tensors without data
        (`_compat.without_data`) and other values give None. Tensors above --max-numel get no digest. Small plain
        tensors are copied and hashed later in a batch (digests filled in by `resolve`); `now` hashes everything at
        once, for callers that compare digests.

        `fresh`: never reuse an earlier snapshot (for tensors written behind the version counter's back, such
        as a collective's output or a DDP bucket)."""
        limit = self.max_numel
        now = now or len(tensors) >= BATCH_TENSORS
        out: list[Snapshot | None] = [None] * len(tensors)
        todo: list[tuple[int, Any, int | None]] = []
        copies: list[tuple[torch.Tensor, Snapshot]] = []
        seen = self._seen
        for i, value in enumerate(tensors):
            if not isinstance(value, torch.Tensor):
                if value is not None and has_components(value):
                    todo.append((i, value, None))
                continue
            if value.is_nested:
                packed = _packed_values(value)
                if packed is None:
                    out[i] = Snapshot(shape=(), dtype=dtype_name(value.dtype), numel=0)
                    continue
                value = packed
            if is_dtensor(value) and (part := self._part(value)) is not None:
                out[i] = part
                continue
            tensor = local_data(value)
            if without_data(tensor):
                continue  # a meta or fake tensor (a FLOP count, a graph being traced): nothing to record (None)
            version = _version(tensor)
            if version is not None and not fresh:
                entry = seen.get(id(tensor))
                if entry is not None and entry[1] == version and entry[0]() is tensor \
                        and entry[2] == tensor.data_ptr():
                    out[i] = entry[3]
                    continue
            if limit is not None and tensor.numel() > limit:
                out[i] = Snapshot(shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype), numel=tensor.numel())
            elif has_components(tensor):
                todo.append((i, tensor, None))
            elif not now and _deferrable(tensor):
                snap = out[i] = Snapshot(shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                                         numel=tensor.numel())
                copies.append((tensor, snap))
                if version is not None:
                    self._remember(tensor, version, snap)
            else:
                todo.append((i, tensor, version))
        if copies:
            self._defer(copies)
        if todo:
            for (i, tensor, version), snap in zip(todo, self._fingerprint([t for _, t, _ in todo]), strict=True):
                out[i] = snap
                if version is not None and snap.digest is not None:
                    self._remember(tensor, version, snap)
        return out

    def _part(self, value: Any) -> Snapshot | None:
        """A sharded DTensor's record: this rank's part of its global fingerprint (`detrace.digest.sharded.part_of`:
        no collective), under the global shape with this rank's numel, so that a reader adds the shards' parts into
        the global tensor's fingerprint. None where it has no such part (a replicated DTensor, a shard that splits a
        word): its local data is recorded instead."""
        local = value.to_local()
        if without_data(local) or (self.max_numel is not None and local.numel() > self.max_numel):
            return None
        with self._own(), torch.no_grad():
            fp = part_of(value, selected_scheme())
        return None if fp is None else Snapshot(shape=fp.shape, dtype=fp.dtype, numel=fp.numel, digest=fp.digest)

    def _remember(self, tensor: torch.Tensor, version: int, snap: Snapshot) -> None:
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.clear()
        self._seen[id(tensor)] = (weakref.ref(tensor), version, tensor.data_ptr(), snap)

    def forget(self) -> None:
        """Reuse no snapshot taken so far: something may have written tensors without bumping their version
        counters. Called when a collective completes (c10d and functional collectives write their outputs from
        C++), when a DDP bucket is handed to its comm hook and when backward ends (DDP's reducer copies
        gradients into buckets and back from C++), when an optimizer starts (optimizers write `.data`) and when
        a step ends."""
        self._seen.clear()

    def _fingerprint(self, values: list[Any]) -> list[Snapshot]:
        """Fingerprints of `values` now, in one batch (one by one if the batch fails, so that one value that
        cannot be fingerprinted costs only its own digest)."""
        from detrace.digest import fingerprint_many
        from detrace.errors import FingerprintError

        with self._own(), torch.no_grad():
            try:
                return [_snapshot_of(fp) for fp in fingerprint_many(values)]
            except FingerprintError:
                pass
            snaps = []
            for value in values:
                try:
                    snaps.append(_snapshot_of(fingerprint_many([value])[0]))
                except FingerprintError:
                    shape = tuple(int(n) for n in getattr(value, "shape", ()))
                    snaps.append(Snapshot(shape=shape, dtype=str(getattr(value, "dtype", type(value).__name__))
                                          .removeprefix("torch."), numel=math.prod(shape)))
            return snaps

    def _defer(self, items: list[tuple[torch.Tensor, Snapshot]]) -> None:
        """Copy the bits of small tensors for the next batch (a plain copy, unseen by dispatch modes)."""
        with disable_dispatch():
            copies = [(tensor.detach().clone(memory_format=torch.contiguous_format), snap) for tensor, snap in items]
        with self._lock:
            self._pending += copies
            self._pending_bytes += sum(copy.nbytes for copy, _ in copies)
            if self._pending_bytes > PENDING_BYTES:
                self.resolve()

    def resolve(self) -> None:
        """Hash the pending copies (one batch) and fill in their snapshots' digests."""
        with self._lock:
            pending, self._pending, self._pending_bytes = self._pending, [], 0
            if not pending:
                return
            try:
                done = self._fingerprint([copy for copy, _ in pending])
            except Exception as err:  # the tracer's own failure: the records are dropped, the program goes on
                self.failed.update(id(snap) for _, snap in pending)
                self.failure = err
                return
            for (_, snap), fingerprint in zip(pending, done, strict=True):
                snap.digest, snap.chunks = fingerprint.digest, fingerprint.chunks

    def drop(self) -> None:
        """Discard the pending copies unhashed (their records are dropped too)."""
        self._pending, self._pending_bytes = [], 0
