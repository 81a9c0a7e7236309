"""The per-process tracer: step clock, windows, rank discovery, record numbering and the rank's writer.

One `Tracer` exists per traced process. The rungs (detrace.tracing.rungs) observe the program and call
`begin()` / `snapshot()` / `emit()`; the tracer numbers records, counts occurrences, applies the windows and
writes batches. It never keeps a tensor: `snapshot()` fingerprints at once and keeps only the digests.

Rank discovery: `RANK` (torchrun) or `torch.distributed.get_rank()` once the default group exists (mp.spawn sets
no RANK). Until the rank is known, records stay in memory; a process that records nothing writes nothing.
A process with neither at the end of a step or at exit is a single-process run: rank 0.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from detrace.errors import DetraceError
from detrace.tracefile.layout import rank_path, run_header_path
from detrace.tracefile.schema import RUNGS
from detrace.tracefile.writer import RankWriter, write_json_atomic
from detrace.tracing.config import TraceConfig
from detrace.tracing.header import base_header

FLUSH_RECORDS = 4096
"""Records buffered before a batch is written."""
FLUSH_SECONDS = 1.0
"""Longest time a record waits in memory before its batch is written (checked at each record)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The fingerprint of one tensor, taken at a moment of the call (the tensor itself is not kept)."""

    shape: tuple[int, ...]
    dtype: str
    numel: int
    digest: int | None
    chunks: tuple[int, ...] | None = None


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


_SEEN_LIMIT = 65536
"""Most snapshots remembered for reuse (a bound on memory, not on correctness)."""


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place version counter of a plain tensor; None where there is none to trust (inference tensors,
    subclasses), so its snapshot is never reused."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return None
    try:
        return tensor._version
    except RuntimeError:
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: DTensors are fingerprinted by their local shard (never gathered: no collective)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor).__name__ == "DTensor" else tensor


class Tracer:
    """The recording state of one process."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.step = 0
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
        self._rows: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._writer: RankWriter | None = None
        self._after_optimizer = False
        self._stepped: set[int] = set()
        self._listeners: list[Callable[[], None]] = []
        self._closed = False
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, Snapshot]] = {}
        """id(tensor) -> (the tensor, its version, its snapshot): a tensor recorded as an output and again as
        the next call's input is fingerprinted once. Cleared when the optimizer starts and when a step ends."""
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

    def set_step(self, step: int) -> None:
        """Set the step clock (e.g. after resuming from a checkpoint taken at `step`)."""
        with self._lock:
            self._seen.clear()
            self.step = int(step)
            self._occurrences = {}
            self._after_optimizer = False
            self._update_windows()

    def end_step(self) -> None:
        """The step is over: write its records and move the clock on."""
        with self._lock:
            self._previous_occurrences = self._occurrences
            self.set_step(self.step + 1)
            self.flush(step_ended=True)

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
                self.set_step(self.step - 1)
                self._occurrences = occurrences
            elif not self._after_optimizer:
                self._stepped = set()
            self._stepped.add(id(optimizer))
            self.phase = "optimizer"
            # Optimizers may write parameters through `.data`, which the version counter does not see.
            self._seen.clear()

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
            self._rows = []
            self.enabled = False
        self._update_windows()

    def _discover_rank(self, *, step_ended: bool) -> int | None:
        """The rank, once known. Once a step has ended (or at exit), a process that has not joined a process
        group and has no RANK is a single-process run: rank 0."""
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._set_rank(dist.get_rank())
            self.world_size = dist.get_world_size()
        elif step_ended:
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

    def snapshot(self, tensors: Sequence[torch.Tensor | None], *, fresh: bool = False) -> list[Snapshot | None]:
        """Fingerprint tensors now (in one batch); None stays None. Tensors above --max-numel get no digest.

        `fresh`: never reuse an earlier snapshot (for tensors written behind the version counter's back, such
        as a collective's output)."""
        from detrace.digest import fingerprint_many
        from detrace.errors import FingerprintError

        limit = self.config.max_numel
        out: list[Snapshot | None] = [None] * len(tensors)
        todo: list[tuple[int, torch.Tensor, int | None]] = []
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                continue
            tensor = local_data(tensor)
            version = _version(tensor)
            seen = self._seen.get(id(tensor)) if version is not None and not fresh else None
            if seen is not None and seen[0]() is tensor and seen[1] == version:
                out[i] = seen[2]
            elif limit is not None and tensor.numel() > limit:
                out[i] = Snapshot(shape=tuple(tensor.shape), dtype=_dtype_name(tensor.dtype), numel=tensor.numel(),
                                  digest=None)
            else:
                todo.append((i, tensor, version))
        if not todo:
            return out
        try:
            with self.own(), torch.no_grad():
                fps: list[Any] = fingerprint_many([t.detach() for _, t, _ in todo])
        except FingerprintError:
            fps = [None] * len(todo)
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.clear()
        for (i, tensor, version), fp in zip(todo, fps, strict=True):
            chunks = tuple(fp.chunks) if fp is not None and fp.chunks else None
            snap = Snapshot(shape=tuple(tensor.shape), dtype=_dtype_name(tensor.dtype), numel=tensor.numel(),
                            digest=None if fp is None else fp.digest, chunks=chunks)
            out[i] = snap
            if version is not None and fp is not None:
                self._seen[id(tensor)] = (weakref.ref(tensor), version, snap)
        return out

    def emit(self, call: Call, role: str, snapshots: Sequence[Snapshot | None]) -> None:
        """Add one record per snapshot (None entries are skipped but keep their index)."""
        with self._lock:
            if not self.enabled:
                return
            for index, snap in enumerate(snapshots):
                if snap is None:
                    continue
                self._add(call, role, index, snap.shape, snap.dtype, snap.numel, snap.digest, snap.chunks, None)

    def emit_metric(self, call: Call, value: float | torch.Tensor, dtype: str) -> None:
        """Add an exact scalar. A tensor value is read at the next flush (one host transfer for the batch)."""
        with self._lock:
            if self.enabled:
                self._add(call, "metric", 0, (), dtype, 1, None, None, value)

    def collective_completed(self) -> None:
        with self._lock:
            self.collectives += 1
            # A collective writes its outputs without bumping their version counters.
            self._seen.clear()

    def next_group_seq(self, group: str) -> int:
        with self._lock:
            seq = self.groups.get(group, 0)
            self.groups[group] = seq + 1
            return seq

    def _add(self, call: Call, role: str, index: int, shape: tuple[int, ...], dtype: str, numel: int,
             digest: int | None, chunks: tuple[int, ...] | None, value: Any) -> None:
        seq = self._seq
        self._seq += 1
        if call.event is None:
            call.event = seq
        self._rows.append({
            "seq": seq, "step": call.step, "rung": call.rung, "phase": call.phase, "module": call.module,
            "name": call.name, "occurrence": call.occurrence, "event": call.event, "role": role, "index": index,
            "shape": list(shape), "dtype": dtype, "numel": numel, "digest": digest,
            "chunks": list(chunks) if chunks is not None else None, "value": value,
            "collectives": self.collectives, "group": call.group, "group_seq": call.group_seq, "peer": call.peer,
            "extra": call.extra,
        })
        if len(self._rows) >= FLUSH_RECORDS or time.monotonic() - self._last_flush >= FLUSH_SECONDS:
            self.flush()

    # -- writing ----------------------------------------------------------------------------------------------

    def _in_dataloader_worker(self) -> bool:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None

    def flush(self, *, step_ended: bool = False) -> None:
        """Hand buffered records to the rank file (opening it on first use, once the rank is known)."""
        with self._lock:
            self._last_flush = time.monotonic()
            if not self._rows or not self.enabled:
                return
            if self._in_dataloader_worker():
                self.disable()
                return
            if self._discover_rank(step_ended=step_ended) is None or not self.enabled:
                return
            rows, self._rows = self._rows, []
            self._materialize(rows)
            try:
                writer = self._writer or self._open()
                for row in rows:
                    writer.add(row)
                writer.flush()
            except (DetraceError, OSError) as err:
                # A failing trace must not take the training run down with it: say so once and stop recording.
                print(f"detrace: tracing stopped on rank {self.rank}: {err}", file=sys.stderr)
                self.disable()

    def _materialize(self, rows: list[dict[str, Any]]) -> None:
        pending = [row for row in rows if isinstance(row["value"], torch.Tensor)]
        if pending:
            with self.own():
                values = torch.stack([row["value"].detach().reshape(()).to("cpu", torch.float64)
                                      for row in pending]).tolist()
            for row, value in zip(pending, values, strict=True):
                row["value"] = value

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
            self._rows = []
            self._update_windows()

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
                          "world_size": self.world_size, "collectives": self.collectives}
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
        if (existing is not None and existing.exists()) or (existing is None and any(out.glob("rank-*.arrow"))):
            raise TraceError(f"{out} already holds a trace; choose another directory or pass force=True")
