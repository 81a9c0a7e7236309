"""The per-process tracer: step clock, windows, rank discovery, record numbering and the rank's writer.

One `Tracer` exists per traced process. The rungs (detrace.tracing.rungs) observe the program and call
`begin()` / `snapshot()` / `emit()`; the tracer numbers records, counts occurrences, applies the windows and
writes batches. It never keeps a tensor of the program's: `snapshot()` copies small tensors (hashed together, one
`fingerprint_many` per flush instead of one per call) and fingerprints the others at once; records are kept as
tuples and written as Arrow columns.

The step clock counts global steps: optimizer steps since the training began, across restarts. It starts at
DETRACE_STEP_OFFSET (0 when unset) and is set by the first source that applies, in this order of precedence:
`detrace.TrainState` on resume ("train_state"), an explicit `detrace.step(n)` / `set_step(n)` ("explicit", or
"env" for the offset), a framework integration ("hf", "lightning", ...), and detection with no edit: an optimizer
restored from a checkpoint carries its step count ("optimizer"). A source of lower precedence never overrides
one of higher precedence. The footer records the first and last global step and the source.

Rank discovery: `RANK` (torchrun) or `torch.distributed.get_rank()` once the default group exists (mp.spawn sets
no RANK). Until the rank is known, records stay in memory; a process that records nothing writes nothing.
A process with neither at the end of a step or at exit is a single-process run: rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from detrace._compat import disable_dispatch, pytree
from detrace.errors import DetraceError
from detrace.tracefile.layout import rank_path, rank_trace_paths, run_header_path
from detrace.tracefile.schema import ARROW_SCHEMA, COLUMN_NAMES, RUNGS
from detrace.tracefile.writer import RankWriter, write_json_atomic
from detrace.tracing.config import TraceConfig
from detrace.tracing.header import base_header

STEP_OFFSET_ENV = "DETRACE_STEP_OFFSET"
"""The global step at which the step clock of a traced process starts (e.g. a run resumed after step K: K)."""

_PRECEDENCE = {"train_state": 0, "explicit": 1, "env": 1, "optimizer": 3, "process": 4}
"""Step sources by precedence (lower wins); any other name is a framework integration, between the two groups."""
INTEGRATION_PRECEDENCE = 2


def precedence(source: str) -> int:
    """How strongly a step source is believed: a source never overrides one with a lower number."""
    return _PRECEDENCE.get(source, INTEGRATION_PRECEDENCE)


def step_offset(environ: Any = os.environ) -> int:
    """DETRACE_STEP_OFFSET as a global step (0 when unset); a malformed value is a UsageError naming it."""
    text = environ.get(STEP_OFFSET_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        from detrace.errors import UsageError

        raise UsageError(f"{STEP_OFFSET_ENV} must be a non-negative integer (a global step), not {text!r}")
    return int(text)


FLUSH_RECORDS = 4096
"""Records buffered before a batch is written."""
FLUSH_SECONDS = 1.0
"""Longest time a record waits in memory before its batch is written (checked at each record)."""


@dataclass(slots=True, kw_only=True)
class Snapshot:
    """The fingerprint of one tensor (or component object) taken at a moment of a call; the tensor itself is not
    kept. A small tensor's bits are copied at that moment and hashed with the rest of its batch, so `digest` is
    filled in later (`Tracer.resolve`, at the latest when its records are written)."""

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


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def has_components(value: object) -> bool:
    """Whether `value` is a quantized tensor or other object fingerprinted as its components."""
    return getattr(type(value), "__detrace_components__", None) is not None


def recorded_leaves(value: Any, *, holes: bool = False) -> list[Any]:
    """The tensors and component objects in a (nested) value, in pytree order: what a record is made of.
    `holes`: None leaves stay, as None, so that indices follow the value's positions."""
    return [leaf for leaf in pytree.tree_leaves(value)
            if isinstance(leaf, torch.Tensor) or (holes and leaf is None) or has_components(leaf)]


def _deferrable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor whose bits a copy can carry to a later batch."""
    return (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter) and tensor.layout == torch.strided \
        and not tensor.is_meta and not tensor.is_quantized and tensor.nbytes <= DEFER_BYTES


def _snapshot_of(fp: Any) -> Snapshot:
    """A Snapshot from a detrace.digest.Fingerprint."""
    return Snapshot(shape=fp.shape, dtype=fp.dtype, numel=fp.numel, digest=fp.digest,
                    chunks=tuple(fp.chunks) if fp.chunks else None,
                    components=tuple((name, _snapshot_of(part)) for name, part in fp.components))


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: DTensors are fingerprinted by their local shard (never gathered: no collective)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor).__name__ == "DTensor" else tensor


_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _alone() -> bool:
    """Nothing marks this process as a rank that will join a process group later: no launcher's variables, and
    not a multiprocessing child (torch.multiprocessing.spawn hands its children their ranks as arguments)."""
    import multiprocessing

    return multiprocessing.parent_process() is None and not any(v in os.environ for v in _RANK_VARIABLES)


class Tracer:
    """The recording state of one process."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.step = step_offset()
        """The global step of the records being made now."""
        self.step_source = "env" if self.step else "process"
        """Where the step clock's value came from ("process": counted from this process's start)."""
        self._first_step: int | None = None
        """The global step of the first step that ended in this process (the first optimizer step)."""
        self._recorded: list[int] = []
        """[first, last] global step that holds records."""
        self.detecting = True
        """Whether an optimizer's restored step count may set the clock (TrainState turns it off while it
        restores: it sets the step itself, afterwards)."""
        self.phase = "forward"
        self.scope: list[str] = []
        """Qualified names of the modules being run, innermost last (kept by the module rung)."""
        self.collectives = 0
        self.enabled = True
        """False in DataLoader workers, forked children, ranks outside the window, and after close."""
        self.rank: int | None = None
        self.world_size: int | None = None
        self.on: dict[str, bool] = {}
        """Per rung: whether it records in the current step on this rank."""
        self.groups: dict[str, int] = {}
        """Process groups seen ("0,1") -> calls made in each; written to the footer as the parallel layout."""
        self._local = threading.local()
        self._lock = threading.RLock()
        self._seq = 0
        self._occurrences: dict[tuple[str, str | None, str], int] = {}
        self._previous_occurrences: dict[tuple[str, str | None, str], int] = {}
        self._records: list[tuple[int, Call, str, int, Snapshot | None, Any, int, str | None]] = []
        """Buffered records: (seq, call, role, index, snapshot, metric value, collectives, extra); columns are
        made of them when a batch is written."""
        self._pending: list[tuple[torch.Tensor, Snapshot]] = []
        """Copies of small recorded tensors and the snapshots whose digests they will give (see DEFER_BYTES)."""
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        self._flush_at = FLUSH_RECORDS
        """Buffered records at which the next flush is tried (further on while the rank is still unknown)."""
        self._writer: RankWriter | None = None
        self._after_optimizer = False
        self._stepped: set[int] = set()
        self._listeners: list[Callable[[], None]] = []
        self._closed = False
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int, Snapshot]] = {}
        """id(tensor) -> (the tensor, its version, its data pointer, its snapshot): a tensor recorded as an output
        and again, unchanged, as the next call's input is fingerprinted once. Only writes that bump the version
        counter are seen, so `forget()` clears it wherever something may have written behind it (see there)."""
        if os.environ.get("RANK", "").isdigit():
            self._set_rank(int(os.environ["RANK"]))
        self._update_windows()

    # -- windows and the step clock -------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever the rungs recording in this step change (rungs switch their hooks)."""
        self._listeners.append(listener)

    def _update_windows(self) -> None:
        top = RUNGS.index(self.config.rung)
        rank_ok = self.enabled and (self.rank is None or self.rank in self.config.rank_window)
        on = {rung: rank_ok and i <= top and self.step in self.config.step_windows[rung]
              for i, rung in enumerate(RUNGS)}
        changed = on != self.on
        self.on = on
        if changed:
            for listener in self._listeners:
                listener()

    def _move_clock(self, step: int) -> None:
        with self._lock:
            self.forget()
            self.step = int(step)
            self._occurrences = {}
            self._after_optimizer = False
            self._update_windows()

    def set_step(self, step: int, source: str = "explicit") -> bool:
        """Set the global step of what runs now (e.g. after resuming from a checkpoint taken after `step` steps),
        unless a source of higher precedence set it already. Returns whether the clock took the value."""
        with self._lock:
            if precedence(source) > precedence(self.step_source):
                return False
            self.step_source = source
            if step != self.step:
                self._move_clock(step)
            return True

    def restored(self, step: int, *, in_step: bool = False) -> None:
        """An optimizer was restored from a checkpoint that carries `step` completed steps (detection with no
        edit). Believed only before this process's first step ended, and below every other source. `in_step`:
        noticed as the first optimizer step begins, so the records still buffered belong to the restored step."""
        with self._lock:
            if self._first_step is not None or step <= 0 or not self.detecting:
                return
            before = self.step
            if self.set_step(step, "optimizer") and in_step:
                # Records of this step made before the optimizer was read (its forward and backward, when the
                # state is read at the first optimizer step) belong to the restored step too.
                for record in self._records:
                    if record[1].step == before:
                        record[1].step = step
                if self._recorded and self._recorded[-1] == before:
                    self._recorded = [step, step] if self._recorded[0] == before else [self._recorded[0], step]

    @property
    def stepped(self) -> bool:
        """Whether a step has ended in this process."""
        return self._first_step is not None

    def end_step(self) -> None:
        """The step is over: write its records and move the clock on."""
        with self._lock:
            if self._first_step is None:
                self._first_step = self.step
            self._previous_occurrences = self._occurrences
            self._move_clock(self.step + 1)
            self.flush(step_ended=True)

    def steps(self) -> dict[str, Any]:
        """The footer's account of the global steps: the first step run, the first and last step holding records,
        and the source of the numbering."""
        first = self._first_step if self._first_step is not None else (self._recorded or [self.step])[0]
        return {"first": first, "recorded": list(self._recorded) or None, "source": self.step_source}

    def user_step(self) -> None:
        """`detrace.step()`: ends the step unless an optimizer step already ended it (and no backward ran since)."""
        if not self._after_optimizer:
            self.end_step()

    def optimizer_begins(self, optimizer: object) -> None:
        """An optimizer's step() starts. A second optimizer stepping right after the first (no backward in
        between) belongs to the same training step, so the clock goes back to it."""
        with self._lock:
            if self._after_optimizer and id(optimizer) not in self._stepped:
                occurrences = self._previous_occurrences
                self._move_clock(self.step - 1)
                self._occurrences = occurrences
            elif not self._after_optimizer:
                self._stepped = set()
            self._stepped.add(id(optimizer))
            self.phase = "optimizer"
            # Optimizers may write parameters through `.data`, which the version counter does not see.
            self.forget()

    def optimizer_ends(self) -> None:
        with self._lock:
            self.phase = "forward"
            self.end_step()
            self._after_optimizer = True

    def backward_begins(self) -> None:
        self._after_optimizer = False

    # -- rank discovery ---------------------------------------------------------------------------------------

    def _set_rank(self, rank: int) -> None:
        self.rank = rank
        if rank not in self.config.rank_window:
            self._drop()
            self.enabled = False
        self._update_windows()

    def _discover_rank(self, *, step_ended: bool) -> int | None:
        """The rank, once known. Once a step has ended (or at exit), a process that has not joined a process
        group and has no RANK is a single-process run: rank 0. So is one that nothing marks as a future rank
        (`_alone`), from its first flush on: the flush every FLUSH_RECORDS records or FLUSH_SECONDS holds from
        the first record, and a single process killed in step 0 keeps its complete batches."""
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._set_rank(dist.get_rank())
            self.world_size = dist.get_world_size()
        elif step_ended or _alone():
            self._set_rank(0)
            self.world_size = 1
        return self.rank

    @property
    def busy(self) -> bool:
        """True while this thread runs the tracer's own tensor code (the op rung must not record it)."""
        return getattr(self._local, "busy", False)

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """Run the tracer's own tensor code (fingerprints, norms) unseen by the op rung."""
        outer = self.busy
        self._local.busy = True
        try:
            yield
        finally:
            self._local.busy = outer

    # -- records ----------------------------------------------------------------------------------------------

    def begin(self, rung: str, phase: str, name: str, module: str | None = None, *, group: str | None = None,
              group_seq: int | None = None, peer: int | None = None, extra: str | None = None) -> Call:
        """Open a call: counts its occurrence in this step. Its records are added with `emit()`."""
        key = (phase, module, name)
        with self._lock:
            occurrence = self._occurrences.get(key, 0)
            self._occurrences[key] = occurrence + 1
        return Call(rung=rung, phase=phase, name=name, module=module, occurrence=occurrence, step=self.step,
                    group=group, group_seq=group_seq, peer=peer, extra=extra)

    def snapshot(self, tensors: Sequence[Any], *, fresh: bool = False, now: bool = False
                 ) -> list[Snapshot | None]:
        """Take the fingerprints of tensors (and component objects) as they are now; None and other values give
        None. Tensors above --max-numel get no digest. Small plain tensors are copied and hashed later in a
        batch (digests filled in by `resolve`); `now` hashes everything at once, for callers that compare digests.

        `fresh`: never reuse an earlier snapshot (for tensors written behind the version counter's back, such
        as a collective's output or a DDP bucket)."""
        limit = self.config.max_numel
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
            tensor = local_data(value)
            version = _version(tensor)
            if version is not None and not fresh:
                entry = seen.get(id(tensor))
                if entry is not None and entry[1] == version and entry[0]() is tensor \
                        and entry[2] == tensor.data_ptr():
                    out[i] = entry[3]
                    continue
            if limit is not None and tensor.numel() > limit:
                out[i] = Snapshot(shape=tuple(tensor.shape), dtype=_dtype_name(tensor.dtype), numel=tensor.numel())
            elif has_components(tensor):
                todo.append((i, tensor, None))
            elif not now and _deferrable(tensor):
                snap = out[i] = Snapshot(shape=tuple(tensor.shape), dtype=_dtype_name(tensor.dtype),
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

        with self.own(), torch.no_grad():
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
            for (_, snap), done in zip(pending, self._fingerprint([copy for copy, _ in pending]), strict=True):
                snap.digest, snap.chunks = done.digest, done.chunks

    def emit(self, call: Call, role: str, snapshots: Sequence[Snapshot | None]) -> None:
        """Add one record per snapshot (None entries are skipped but keep their index). A component object is
        one record (its digest covers every component) followed by one record per component, role "component",
        numbered within the call, with extra {"component": name, "of": role, "index": its index}."""
        with self._lock:
            if not self.enabled:
                return
            for index, snap in enumerate(snapshots):
                if snap is None:
                    continue
                self._add(call, role, index, snap, None, call.extra)
                for name, part in snap.components:
                    extra = json.loads(call.extra) if call.extra else {}
                    extra.update(component=name, of=role, index=index)
                    self._add(call, "component", call.components, part, None, json.dumps(extra))
                    call.components += 1

    def emit_metric(self, call: Call, value: float | torch.Tensor, dtype: str) -> None:
        """Add an exact scalar. A tensor value is read at the next flush (one host transfer for the batch)."""
        with self._lock:
            if self.enabled:
                self._add(call, "metric", 0, Snapshot(shape=(), dtype=dtype, numel=1), value, call.extra)

    def collective_completed(self) -> None:
        with self._lock:
            self.collectives += 1
            self.forget()

    def next_group_seq(self, group: str) -> int:
        with self._lock:
            seq = self.groups.get(group, 0)
            self.groups[group] = seq + 1
            return seq

    def _add(self, call: Call, role: str, index: int, snap: Snapshot, value: Any, extra: str | None) -> None:
        seq = self._seq
        self._seq = seq + 1
        if not self._recorded:
            self._recorded = [call.step, call.step]
        elif call.step > self._recorded[1]:
            self._recorded[1] = call.step
        if call.event is None:
            call.event = seq
        self._records.append((seq, call, role, index, snap, value, self.collectives, extra))
        if len(self._records) >= self._flush_at or time.monotonic() - self._last_flush >= FLUSH_SECONDS:
            self.flush()

    # -- writing ----------------------------------------------------------------------------------------------

    def _in_dataloader_worker(self) -> bool:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None

    def flush(self, *, step_ended: bool = False) -> None:
        """Hand buffered records to the rank file (opening it on first use, once the rank is known)."""
        with self._lock:
            self._last_flush = time.monotonic()
            self._flush_at = len(self._records) + FLUSH_RECORDS
            if not self._records or not self.enabled:
                return
            if self._in_dataloader_worker():
                self.disable()
                return
            if self._discover_rank(step_ended=step_ended) is None or not self.enabled:
                return
            self.resolve()
            records, self._records = self._records, []
            self._flush_at = FLUSH_RECORDS
            try:
                writer = self._writer or self._open()
                writer.add_batch(self._batch(records))
            except (DetraceError, OSError) as err:
                # A failing trace must not take the training run down with it: say so once and stop recording.
                print(f"detrace: tracing stopped on rank {self.rank}: {err}", file=sys.stderr)
                self.disable()

    def _batch(self, records: list[tuple[int, Call, str, int, Snapshot | None, Any, int, str | None]]
               ) -> pa.RecordBatch:
        """The Arrow batch of buffered records (columns in schema order; metric tensors read in one transfer)."""
        seq, calls, roles, indices, snaps, values, collectives, extras = (
            list(column) for column in zip(*records, strict=True))
        tensors = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
        if tensors:
            with self.own():
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
        return pa.record_batch([pa.array(columns[name], type=ARROW_SCHEMA.field(name).type) for name in COLUMN_NAMES],
                               schema=ARROW_SCHEMA)

    def _open(self) -> RankWriter:
        assert self.rank is not None
        if self.world_size is None:
            env = os.environ.get("WORLD_SIZE", "")
            self.world_size = int(env) if env.isdigit() else None
        header = base_header(self.config, world_size=self.world_size)
        header.update(rank=self.rank, pid=os.getpid())
        # Inside `detrace run` the launcher already refused or cleared an existing trace; a rank file there is
        # this rank's own from an elastic restart of the same run, so it is replaced.
        self._writer = RankWriter(self.config.out, self.rank, header=header, force=self.config.force or
                                  self.config.launched, batch_records=1 << 30, flush_seconds=float("inf"))
        return self._writer

    def disable(self) -> None:
        """Stop recording for good in this process, dropping what is buffered."""
        with self._lock:
            self.enabled = False
            self._drop()
            self._update_windows()

    def _drop(self) -> None:
        self._records, self._pending, self._pending_bytes = [], [], 0

    def abandon(self) -> None:
        """In a forked child: forget the parent's writer without touching its file, and record nothing."""
        self._writer = None
        self._closed = True
        self.disable()

    def close(self) -> None:
        """Write the last records and the footer (rank complete)."""
        with self._lock:
            if self._closed:
                return
            self.flush(step_ended=True)
            self._closed = True
            writer = self._writer
            if writer is not None:
                footer = {"groups": sorted(self.groups), "step": self.step, "pid": os.getpid(),
                          "world_size": self.world_size, "collectives": self.collectives, "steps": self.steps()}
                writer.close(footer)
                if self.rank == 0 and not self.config.launched:
                    header = base_header(self.config, world_size=self.world_size)
                    write_json_atomic(run_header_path(self.config.out), header)
            self.enabled = False
            self._update_windows()

    def check_out_dir(self) -> None:
        """Library form: refuse (before training starts) an out directory that already holds this rank's trace."""
        from detrace.errors import TraceError

        if self.config.force or self.config.launched:
            return
        out = self.config.out
        existing = rank_path(out, self.rank) if self.rank is not None else None
        if (existing is not None and existing.exists()) or (existing is None and rank_trace_paths(out)):
            raise TraceError(f"{out} already holds a trace; choose another directory or pass force=True")
