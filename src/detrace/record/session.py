"""The per-process tracer: windows, rank discovery, the record buffer and the rank's writer.

One `Tracer` exists per traced process. The rungs (detrace.record.rungs) observe the program and call
`begin()` / `snapshot()` / `emit()`; the tracer numbers records, applies the windows and writes batches. It composes
the step clock (`clock`, detrace.record.steps: the global step and each call's occurrence, `begin()`) and the
snapshot memo (`snapshots`, detrace.record.snapshots: the fingerprints, `snapshot()`), and keeps the records as
tuples (detrace.record.records) until a batch of them is written as Arrow columns.

Rank discovery: `RANK` (torchrun) or `torch.distributed.get_rank()` once the default group exists (mp.spawn sets
no RANK). Until the rank is known, records stay in memory; a process that records nothing writes nothing.
A process with neither at the end of a step or at exit is a single-process run: rank 0.

A process that a recording process started (an eval subprocess, a data preprocessor, a compile worker: it
inherits RECORDING_VAR) is a rank only once it joins a process group (mp.spawn's children do); otherwise it is
auxiliary and writes `aux-<pid>.arrow`, never a rank's file, whatever RANK it inherited.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from detrace._numbers import parse_count
from detrace.errors import DetraceError, os_error_text
from detrace.record.config import RECORDING_VAR, TraceConfig
from detrace.record.header import base_header
from detrace.record.records import Call, Record, Snapshot, to_batch
from detrace.record.snapshots import SnapshotMemo
from detrace.record.steps import StepClock
from detrace.tracefile.layout import rank_path, rank_trace_paths, run_header_path
from detrace.tracefile.schema import RUNGS
from detrace.tracefile.writer import RankWriter, write_json_atomic

FLUSH_RECORDS = 4096
"""Records buffered before a batch is written."""
FLUSH_SECONDS = 1.0
"""Longest time a record waits in memory before its batch is written (checked at each record)."""

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
        self._lock = threading.RLock()
        """Guards the clock, the pending snapshot copies and the record buffer (rungs may record from threads)."""
        self.clock = StepClock(lock=self._lock, moved=self._clock_moved)
        self.begin = self.clock.begin
        """Open a call (`StepClock.begin`), bound here: the rungs call it for every call they record."""
        self._local = threading.local()
        self.snapshots = SnapshotMemo(max_numel=config.max_numel, own=self.own, lock=self._lock)
        self.forget = self.snapshots.forget
        """Reuse no snapshot taken so far (`SnapshotMemo.forget`)."""
        self._recorded: list[int] = []
        """[first, last] global step that holds records."""
        self.phase = "forward"
        """What runs now: "forward" (the training's own work outside the backward and the optimizer step, including
        what trails the step), "backward", "optimizer", or "evaluation" (see `evaluation_begins`)."""
        self.scope: list[str] = []
        """Qualified names of the modules being run, innermost last (kept by the module rung)."""
        self.collectives = 0
        self.enabled = True
        """False in DataLoader workers, forked children, ranks outside the window, and after close."""
        self.rank: int | None = None
        self.world_size: int | None = None
        self.on: dict[str, bool] = {}
        """Per rung: whether it records in the current step on this rank."""
        self.warnings: list[str] = []
        """The integrations' warnings to the user (`detrace.record.warned`), written to the footer."""
        self.unmade = 0
        """Records that could not be made (`could_not`): said in the footer's warnings, and so in the verdicts."""
        self._unmade_why = ""
        """The first reason a record could not be made."""
        self.groups: dict[str, int] = {}
        """Process groups seen ("0,1") -> calls made in each; written to the footer as the parallel layout."""
        self._seq = 0
        self._records: list[Record] = []
        """Buffered records; columns are made of them when a batch is written."""
        self._held: tuple[int, list[int]] | None = None
        """Where in `_records` the records of an evaluation that may turn out to be the next step's work begin, and
        `_recorded` then (`hold`): until it is known which step they belong to, nothing is written."""
        self._last_flush = time.monotonic()
        self._flush_at = FLUSH_RECORDS
        """Buffered records at which the next flush is tried (further on while the rank is still unknown)."""
        self._writer: RankWriter | None = None
        self._listeners: list[Callable[[], None]] = []
        self._closing: list[Callable[[], None]] = []
        self._closed = False
        self.nested = os.environ.get(RECORDING_VAR, str(os.getpid())) != str(os.getpid())
        """Started by a process that was recording: not a rank unless it joins a process group."""
        self.aux = False
        """Known not to be a rank: its records go to an auxiliary trace (`aux-<pid>.arrow`)."""
        if not self.nested and (rank := parse_count(os.environ.get("RANK", ""))) is not None:
            self._set_rank(rank)
        self._update_windows()

    # -- windows and the steps --------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever the rungs recording in this step change (rungs switch their hooks)."""
        self._listeners.append(listener)

    def _update_windows(self, *, also: int | None = None) -> None:
        """Switch on the rungs whose windows hold the current step (or step `also`)."""
        top = RUNGS.index(self.config.rung)
        rank_ok = self.enabled and (self.rank is None or self.rank in self.config.rank_window)
        steps = [self.clock.step] if also is None else [self.clock.step, also]
        on = {rung: rank_ok and i <= top and any(step in self.config.step_windows[rung] for step in steps)
              for i, rung in enumerate(RUNGS)}
        changed = on != self.on
        self.on = on
        if changed:
            for listener in self._listeners:
                listener()

    def add_closing(self, recorder: Callable[[], None]) -> None:
        """Call `recorder()` as the trace closes, before its last records are written: it records the state the
        run ends with (phase "final", `final_step`)."""
        self._closing.append(recorder)

    @property
    def final_step(self) -> int:
        """The step the final state is recorded in: the last step that holds records (the clock's, when none does),
        so that recording it never adds a step to the run."""
        return self._recorded[1] if self._recorded else self.clock.step

    def _clock_moved(self) -> None:
        # A new step: its windows apply, and a snapshot taken in the last one is not reused.
        self.snapshots.forget()
        self._update_windows()

    def restored(self, step: int, *, in_step: bool = False) -> None:
        """An optimizer was restored from a checkpoint that carries `step` completed steps (`StepClock.restored`).
        `in_step`: noticed as the first optimizer step begins, so the records still buffered belong to the
        restored step."""
        with self._lock:
            before = self.clock.step
            if self.clock.restored(step) and in_step:
                # Records of this step made before the optimizer was read (its forward and backward, when the
                # state is read at the first optimizer step) belong to the restored step too.
                for record in self._records:
                    if record[1].step == before:
                        record[1].step = step
                if self._recorded and self._recorded[-1] == before:
                    self._recorded = [step, step] if self._recorded[0] == before else [self._recorded[0], step]

    def snapshot(self, tensors: Sequence[Any], *, fresh: bool = False, now: bool = False) -> list[Snapshot | None]:
        """Fingerprints of tensors as they are now (`SnapshotMemo.snapshot`); None for each when they cannot be
        taken (`could_not`: the program goes on)."""
        try:
            return self.snapshots.snapshot(tensors, fresh=fresh, now=now)
        except Exception as err:
            self.could_not(len(tensors), err)
            return [None] * len(tensors)

    def could_not(self, records: int, err: BaseException) -> None:
        """`records` records could not be made (`err` says why): an error of the tracer's, never the program's, so
        it is noted (once on stderr, and in the footer's warnings) and the program goes on."""
        with self._lock:
            if not self.unmade:
                first = str(err).splitlines()[0] if str(err) else ""
                self._unmade_why = f"{type(err).__name__}: {first}" if first else type(err).__name__
                print(f"detrace: a record could not be made in process {os.getpid()} ({self._unmade_why}); the "
                      "program goes on, and its trace says so", file=sys.stderr)
            self.unmade += max(records, 1)

    def evaluation_begins(self) -> None:
        """A forward of the trained model outside the training (`detrace.record.rungs.batch.evaluates`): what runs
        from now until the training's work begins again is the evaluation, in the step it follows."""
        with self._lock:
            if self.phase == "forward":
                self.phase = "evaluation"

    def training_begins(self, *, held_was_work: bool = False) -> None:
        """The training's work begins (a training forward, a backward, an optimizer's closure): an evaluation is
        over, and so is the trailing work of the step before (`StepClock.work_begins`). `held_was_work`: the
        records held since `hold` were this work's beginning, not an evaluation (`_settle`)."""
        with self._lock:
            if self.phase == "evaluation":
                self.phase = "forward"
            self.clock.work_begins()
            self._settle(work=held_was_work)

    def hold(self) -> None:
        """The evaluation beginning now may be the next step's work instead: a frozen model's forward after an
        optimizer step is a distillation teacher's when the training forward that follows takes the same batch
        (detrace.record.rungs.batch). Its records are kept back until `training_begins` says which it was (or the
        step ends, or the trace closes: an evaluation), and made under the windows of this step and the next: the
        window of the step they turn out to belong to decides which are kept."""
        with self._lock:
            if self._held is None:
                self._held = (len(self._records), list(self._recorded))
                self._update_windows(also=self.clock.upcoming)

    @property
    def holding(self) -> bool:
        """Whether records are held (`hold`)."""
        return self._held is not None

    def let_go(self) -> None:
        """The held records were an evaluation's after all: they stay in the step they were made in."""
        with self._lock:
            self._settle(work=False)

    def _settle(self, *, work: bool) -> None:
        """Write the held records (`hold`) into the step they belong to, those its windows record, with dense
        sequence numbers. `work`: they were the work of the step that begins now (a teacher's forward), and move
        into it as a process that ran no step before records them (a resumed one: its teacher's first forward is
        the step's work): phase "forward", "data" for the batch entering the model (whose outputs only an
        evaluation records), numbered in the new step in their order. A continuous run and one resumed after the
        teacher came in thus hold the same records."""
        if self._held is None:
            return
        (start, self._recorded), self._held = self._held, None
        held = self._records[start:]
        del self._records[start:]
        if held:
            self._seq = held[0][0]
        batches = {id(call) for _, call, *_ in held if call.rung == "semantic" and call.name == "batch"
                   and call.phase == "evaluation"}
        moved: set[int] = set()
        for _, call, role, index, snap, value, _, extra in held:
            if work and id(call) in batches and (role == "output" or (
                    role == "component" and extra is not None and json.loads(extra).get("of") == "output")):
                continue
            if work and id(call) not in moved:
                moved.add(id(call))
                if call.phase == "evaluation":
                    call.phase = "data" if id(call) in batches else "forward"
                call.step, call.event = self.clock.step, None
                call.occurrence = self.clock.occurrence(call.phase, call.module, call.name)
            if snap is not None and call.step in self.config.step_windows[call.rung]:  # (buffered: never None)
                self._add(call, role, index, snap, value, extra)
        self._update_windows()

    def end_step(self) -> None:
        """The step is over: move the clock on and write the step's records."""
        with self._lock:
            if self.phase == "evaluation":
                self.phase = "forward"
            self.clock.advance()
            self.flush(step_ended=True)

    def user_step(self) -> None:
        """`detrace.step()`: ends the step, or its trailing work when an optimizer step ended its compute."""
        if self.clock.trailing:
            self.training_begins()
        else:
            self.end_step()

    def optimizer_begins(self, optimizer: object) -> None:
        """An optimizer's step() starts (`StepClock.optimizer_begins`): the optimizer phase."""
        with self._lock:
            self.clock.optimizer_begins(optimizer)
            self.phase = "optimizer"
            # Optimizers may write parameters through `.data`, which the version counter does not see.
            self.snapshots.forget()

    def optimizer_ends(self) -> None:
        with self._lock:
            self.phase = "forward"
            self.clock.optimizer_ends()
            self.flush(step_ended=True)

    # -- rank discovery ---------------------------------------------------------------------------------------

    def _set_rank(self, rank: int) -> None:
        self.rank = rank
        if rank not in self.config.rank_window:
            self._drop()
            self.enabled = False
        self._update_windows()

    def _discover_rank(self, *, step_ended: bool) -> bool:
        """Whether this process knows which file it writes. Once a step has ended (or at exit), a process that
        has not joined a process group and has no RANK is a single-process run: rank 0. So is one that nothing
        marks as a future rank (`_alone`), from its first flush on: the flush every FLUSH_RECORDS records or
        FLUSH_SECONDS holds from the first record, and a single process killed in step 0 keeps its complete
        batches. A nested process (see the module's docstring) that has joined no group then is auxiliary."""
        if self.rank is not None or self.aux:
            return True
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._set_rank(dist.get_rank())
            self.world_size = dist.get_world_size()
        elif self.nested and step_ended:
            self.aux = True
        elif step_ended or (not self.nested and _alone()):
            self._set_rank(0)
            self.world_size = 1
        return self.rank is not None or self.aux

    @property
    def who(self) -> str:
        """This process in messages: its rank, or that it is not one."""
        return f"rank {self.rank}" if self.rank is not None else f"process {os.getpid()} (not a rank)"

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
            self.snapshots.forget()

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
            # A process started from here on writes another file (see the module's docstring).
            os.environ[RECORDING_VAR] = str(os.getpid())
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
            if self._held is not None:
                if not step_ended:
                    return  # not yet known in which step and phase the held records belong
                self._settle(work=False)  # the step ended (or the trace closes) with no training forward
            if not self._records or not self.enabled:
                return
            if self._in_dataloader_worker():
                self.disable()
                return
            if not self._discover_rank(step_ended=step_ended) or not self.enabled:
                return
            records, self._records = self._records, []
            self._flush_at = FLUSH_RECORDS
            try:
                writer = self._writer or self._open()  # first: a trace whose every batch is lost still says why
                try:
                    self.snapshots.resolve()
                    records = self._without_failed(records)
                    if not records:
                        return
                    with self.own():
                        batch = to_batch(records)
                except Exception as err:  # the batch is lost, the trace and the program go on
                    self.snapshots.drop()
                    self.could_not(len(records), err)
                    return
                writer.add_batch(batch)
            except (DetraceError, OSError) as err:
                self._failed(err)

    def _without_failed(self, records: list[Record]) -> list[Record]:
        """`records` less those whose digests could not be taken (`SnapshotMemo.failed`), noted (`could_not`)."""
        failed, failure = self.snapshots.failed, self.snapshots.failure
        if not failed or failure is None:
            return records
        kept = [record for record in records if record[4] is None or id(record[4]) not in failed]
        self.could_not(len(records) - len(kept), failure)
        failed.clear()
        return kept

    def _failed(self, err: DetraceError | OSError) -> None:
        # A failing trace must not take the training run down with it: say so once and stop recording.
        why = os_error_text(err, self.config.out) if isinstance(err, OSError) else str(err)
        print(f"detrace: tracing stopped on {self.who}: {why}; the trace is cut short", file=sys.stderr)
        self.disable()

    def _open(self) -> RankWriter:
        assert self.rank is not None or self.aux
        if self.world_size is None and not self.aux:
            self.world_size = parse_count(os.environ.get("WORLD_SIZE", ""))
        header = base_header(self.config, world_size=self.world_size)
        header.update(rank=self.rank, pid=os.getpid(), aux=self.aux)
        # Inside `detrace run` the launcher already refused or cleared an existing trace; a rank file there is
        # this rank's own from an elastic restart of the same run, so it is replaced.
        self._writer = RankWriter(self.config.out, self.rank, header=header, force=self.config.force or
                                  self.config.launched, batch_records=1 << 30, flush_seconds=float("inf"),
                                  aux_pid=os.getpid() if self.aux else None)
        return self._writer

    def disable(self) -> None:
        """Stop recording for good in this process, dropping what is buffered."""
        with self._lock:
            self.enabled = False
            self._drop()
            self._update_windows()

    def _drop(self) -> None:
        self._records = []
        self._held = None
        self.snapshots.drop()

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
            for recorder in self._closing if self.enabled else ():
                try:
                    recorder()
                except Exception as err:  # the final state is a record like any other: never the program's failure
                    print(f"detrace: the final state of {self.who} was not recorded: {type(err).__name__}: {err}",
                          file=sys.stderr)
            self.flush(step_ended=True)
            self._closed = True
            writer = self._writer
            if writer is not None and self.enabled:
                footer = {"groups": sorted(self.groups), "step": self.clock.step, "pid": os.getpid(),
                          "world_size": self.world_size, "collectives": self.collectives,
                          "steps": self.clock.steps(self._recorded)}
                warnings = [*self.warnings, *([f"{self.unmade} record{'s' * (self.unmade > 1)} could not be made: "
                                               f"{self._unmade_why}"] if self.unmade else [])]
                if warnings:
                    footer["warnings"] = warnings
                try:
                    writer.close(footer)
                    if self.rank == 0 and not self.config.launched:
                        header = base_header(self.config, world_size=self.world_size)
                        write_json_atomic(run_header_path(self.config.out), header)
                except (DetraceError, OSError) as err:  # at exit too: one sentence, never a traceback
                    self._failed(err)
            self.enabled = False
            self._update_windows()
            if os.environ.get(RECORDING_VAR) == str(os.getpid()):  # the file is closed: no child can clash with it
                del os.environ[RECORDING_VAR]

    def check_out_dir(self) -> None:
        """Library form: refuse (before training starts) an out directory that already holds this rank's trace."""
        from detrace.errors import TraceError

        if self.config.force or self.config.launched:
            return
        out = self.config.out
        existing = rank_path(out, self.rank) if self.rank is not None else None
        if (existing is not None and existing.exists()) or (existing is None and rank_trace_paths(out)):
            raise TraceError(f"{out} already holds a trace; choose another directory or pass force=True")
