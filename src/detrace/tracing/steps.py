"""The step clock: the global step of what runs now, where that number came from, and the numbering of the calls
made in it (their occurrences).

The step clock counts global steps: optimizer steps since the training began, across restarts. It starts at
DETRACE_STEP_OFFSET (0 when unset) and is set by the first source that applies, in this order of precedence:
`detrace.TrainState` on resume ("train_state"), an explicit `detrace.step(n)` / `set_step(n)` ("explicit", or
"env" for the offset), a framework integration ("hf", "lightning", ...), and detection with no edit: an optimizer
restored from a checkpoint carries its step count ("optimizer"). A source of lower precedence never overrides
one of higher precedence. The footer records the first and last global step and the source (`StepClock.steps`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from detrace.numbers import parse_count
from detrace.tracing.records import Call

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
        self.after_optimizer = False
        """Whether an optimizer step ended the current step and no backward ran since (`detrace.step()` then
        ends nothing)."""
        self._first_step: int | None = None
        """The global step of the first step that ended in this process (the first optimizer step)."""
        self._stepped: set[int] = set()
        """id() of the optimizers that stepped in the current training step."""
        self._occurrences: dict[tuple[str, str | None, str], int] = {}
        """(phase, module, name) -> calls made so far in the current step."""
        self._previous_occurrences: dict[tuple[str, str | None, str], int] = {}
        """The same for the step before (a second optimizer stepping goes back to it)."""
        self._lock = lock
        """The tracer's lock."""
        self._moved = moved
        """Called whenever the step changes: reused snapshots and the windows depend on it."""

    def begin(self, rung: str, phase: str, name: str, module: str | None = None, *, group: str | None = None,
              group_seq: int | None = None, peer: int | None = None, extra: str | None = None) -> Call:
        """Open a call: counts its occurrence in this step. Its records are added with `Tracer.emit()`."""
        key = (phase, module, name)
        with self._lock:
            occurrence = self._occurrences.get(key, 0)
            self._occurrences[key] = occurrence + 1
        return Call(rung=rung, phase=phase, name=name, module=module, occurrence=occurrence, step=self.step,
                    group=group, group_seq=group_seq, peer=peer, extra=extra)

    def _move(self, step: int) -> None:
        with self._lock:
            self.step = int(step)
            self._occurrences = {}
            self.after_optimizer = False
            self._moved()

    def set_step(self, step: int, source: str = "explicit") -> bool:
        """Set the global step of what runs now (e.g. after resuming from a checkpoint taken after `step` steps),
        unless a source of higher precedence set it already. Returns whether the clock took the value."""
        with self._lock:
            if precedence(source) > precedence(self.source):
                return False
            self.source = source
            if step != self.step:
                self._move(step)
            return True

    def restored(self, step: int) -> bool:
        """An optimizer was restored from a checkpoint that carries `step` completed steps (detection with no
        edit). Believed only before this process's first step ended, and below every other source. Returns
        whether the clock took the value."""
        with self._lock:
            if self._first_step is not None or step <= 0 or not self.detecting:
                return False
            return self.set_step(step, "optimizer")

    @property
    def stepped(self) -> bool:
        """Whether a step has ended in this process."""
        return self._first_step is not None

    def advance(self) -> None:
        """The step is over: the clock moves on to the next."""
        with self._lock:
            if self._first_step is None:
                self._first_step = self.step
            self._previous_occurrences = self._occurrences
            self._move(self.step + 1)

    def optimizer_begins(self, optimizer: object) -> None:
        """An optimizer's step() starts. A second optimizer stepping right after the first (no backward in
        between) belongs to the same training step, so the clock goes back to it."""
        with self._lock:
            if self.after_optimizer and id(optimizer) not in self._stepped:
                occurrences = self._previous_occurrences
                self._move(self.step - 1)
                self._occurrences = occurrences
            elif not self.after_optimizer:
                self._stepped = set()
            self._stepped.add(id(optimizer))

    def backward_begins(self) -> None:
        """A backward pass starts: the next optimizer step is a new training step."""
        self.after_optimizer = False

    def steps(self, recorded: list[int]) -> dict[str, Any]:
        """The footer's account of the global steps: the first step run, the first and last step holding records
        (`recorded`: [first, last], empty when none), and the source of the numbering."""
        first = self._first_step if self._first_step is not None else (recorded or [self.step])[0]
        return {"first": first, "recorded": list(recorded) or None, "source": self.source}
