"""The step clock: the global step of what runs now, where that number came from, and the numbering of the calls
made in it (their occurrences).

The step clock counts global steps: optimizer steps since the training began, across restarts. It starts at
DETRACE_STEP_OFFSET (0 when unset) and is set by the first source that applies, in this order of precedence:
`detrace.TrainState` on resume ("train_state"), an explicit `detrace.step(n)` / `set_step(n)` ("explicit", or
"env" for the offset), a framework integration ("hf", "lightning", ...) or a checkpoint load whose save the stopped
run of `check-resume --native` logged with its completed steps ("checkpoint"), and detection with no edit: an
optimizer restored from a checkpoint carries its step count ("optimizer"; SGD keeps none, and a checkpoint may
leave the optimizer out, so this is the last resort). A source of lower precedence never overrides one of higher
precedence. The footer records the first and last global step and the source (`StepClock.steps`).

Only training steps move the clock: an optimizer step run inside a checkpoint save or load, or by torch's
initialisation of a fresh optimizer's state (`torch.distributed.checkpoint.state_dict` steps it with zero
gradients and a zero learning rate), is not one (`checkpoint_depth`).

A step's trailing work belongs to that step: what runs after the optimizer step (a loss logged after
`optimizer.step()`, a framework's logging gathers, a checkpoint saved there) is recorded in the step that just
ended, not in the next one. The clock moves on lazily, when the next step's work begins: the next forward call of
the model (an outermost module with parameters), the next backward, the next optimizer step (of an optimizer that
already stepped), or `detrace.step()`. A resumed process, which never ran the step before the one it resumes at,
then holds none of that step's trailing records, and the step both runs share starts at the same record.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from detrace._numbers import parse_count
from detrace.record.records import Call

STEP_OFFSET_ENV = "DETRACE_STEP_OFFSET"
"""The global step at which the step clock of a traced process starts (e.g. a run resumed after step K: K)."""

_PRECEDENCE = {"train_state": 0, "explicit": 1, "env": 1, "checkpoint": 2, "optimizer": 3, "process": 4}
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
    offset = parse_count(text)
    if offset is None:
        from detrace.errors import UsageError

        raise UsageError(f"{STEP_OFFSET_ENV} must be a non-negative integer (a global step), not {text!r}")
    return offset


class StepClock:
    """The global step of one traced process and the occurrence count of each call in it."""

    def __init__(self, *, lock: threading.RLock, moved: Callable[[], None]) -> None:
        self.step = step_offset()
        """The global step of the records being made now."""
        self.source = "env" if self.step else "process"
        """Where the value came from ("process": counted from this process's start)."""
        self.detecting = True
        """Whether an optimizer's restored step count may set the clock (TrainState turns it off while it
        restores: it sets the step itself, afterwards)."""
        self.trailing = False
        """Whether an optimizer step ended the current step's compute and the next step's work has not begun: records
        made now are the step's trailing work (see the module's docstring)."""
        self._next: int | None = None
        """The global step the next step gets when it begins (set while trailing; None: this step + 1)."""
        self._first_step: int | None = None
        """The global step of the first step that ended in this process (the first optimizer step)."""
        self._stepped: set[int] = set()
        """id() of the optimizers that stepped in the current training step."""
        self._occurrences: dict[tuple[str, str | None, str], int] = {}
        """(phase, module, name) -> calls made so far in the current step."""
        self.checkpoint_depth = 0
        """Checkpoint saves or loads running now (`detrace.record.checkpoint_io`): calls begun meanwhile are in
        phase "checkpoint"."""
        self.lock = lock
        """The tracer's lock."""
        self._moved = moved
        """Called whenever the step changes: reused snapshots and the windows depend on it."""

    def begin(self, rung: str, phase: str, name: str, module: str | None = None, *, group: str | None = None,
              group_seq: int | None = None, peer: int | None = None, extra: str | None = None) -> Call:
        """Open a call: counts its occurrence in this step. Its records are added with `Tracer.emit()`. While a
        checkpoint is saved or loaded, every call is in phase "checkpoint"."""
        if self.checkpoint_depth:
            phase = "checkpoint"
        return Call(rung=rung, phase=phase, name=name, module=module, occurrence=self.occurrence(phase, module, name),
                    step=self.step, group=group, group_seq=group_seq, peer=peer, extra=extra)

    def occurrence(self, phase: str, module: str | None, name: str) -> int:
        """Count one more call of (phase, module, name) in this step; returns its occurrence (0 for the first)."""
        key = (phase, module, name)
        with self.lock:
            occurrence = self._occurrences.get(key, 0)
            self._occurrences[key] = occurrence + 1
        return occurrence

    def _move(self, step: int) -> None:
        with self.lock:
            self.step = int(step)
            self._occurrences = {}
            self.trailing = False
            self._next = None
            self._moved()

    def set_step(self, step: int, source: str = "explicit") -> bool:
        """Set the global step of what runs now (e.g. after resuming from a checkpoint taken after `step` steps),
        unless a source of higher precedence set it already. Returns whether the clock took the value. While the step
        is trailing (after its optimizer step), `step` is the number of the step that begins next (a framework's
        step-end hook says "global step N+1" there)."""
        with self.lock:
            if precedence(source) > precedence(self.source):
                return False
            self.source = source
            if self.trailing:
                self._next = step
            elif step != self.step:
                self._move(step)
            return True

    def restored(self, step: int) -> bool:
        """An optimizer was restored from a checkpoint that carries `step` completed steps (detection with no
        edit). Believed only before this process's first step ended, and below every other source. Returns
        whether the clock took the value."""
        with self.lock:
            if self._first_step is not None or step <= 0 or not self.detecting:
                return False
            return self.set_step(step, "optimizer")

    def loaded(self, step: int) -> bool:
        """The program loaded a checkpoint saved after `step` completed steps. Believed only before this process's
        first step ended (a later load is the program's own business: an evaluation, a rollback). Returns whether
        the clock took the value."""
        with self.lock:
            if self._first_step is not None:
                return False
            return self.set_step(step, "checkpoint")

    @property
    def stepped(self) -> bool:
        """Whether a step has ended in this process."""
        return self._first_step is not None

    def advance(self) -> None:
        """The step is over (`detrace.step()` in a loop without an optimizer): the clock moves on now."""
        with self.lock:
            if self._first_step is None:
                self._first_step = self.step
            self._move(self.step + 1)

    def optimizer_ends(self) -> None:
        """The optimizer step ended the step's compute: what follows is the step's trailing work."""
        with self.lock:
            if self._first_step is None:
                self._first_step = self.step
            self.trailing = True

    @property
    def upcoming(self) -> int:
        """The global step the next step gets when it begins."""
        return self.step + 1 if self._next is None else self._next

    def work_begins(self) -> None:
        """The next step's work begins (its forward, its backward): a trailing step is over."""
        if self.trailing:
            with self.lock:
                if self.trailing:
                    self._move(self.upcoming)

    def optimizer_begins(self, optimizer: object) -> None:
        """An optimizer's step() starts. A second optimizer stepping right after the first (no forward or backward
        in between) belongs to the same training step; one that stepped already begins the next step."""
        with self.lock:
            if self.trailing and id(optimizer) in self._stepped:
                self.work_begins()
            if not self.trailing:
                self._stepped = set()
            self._stepped.add(id(optimizer))

    def steps(self, recorded: list[int]) -> dict[str, Any]:
        """The footer's account of the global steps: the first step run, the first and last step holding records
        (`recorded`: [first, last], empty when none), and the source of the numbering."""
        first = self._first_step if self._first_step is not None else (recorded or [self.step])[0]
        return {"first": first, "recorded": list(recorded) or None, "source": self.source}
