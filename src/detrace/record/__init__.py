"""The tracer: per-rank traces of the four recording rungs, from an unmodified program.

Library form::

    with detrace.trace("runs/a", rung="semantic", steps="0-9"):
        train()                       # steps come from optimizer.step(); detrace.step() for loops without one
        detrace.metric("lr", lr)      # optional exact scalars

Zero-edit form: `detrace run --out runs/a --rung semantic -- CMD...` arms the same tracer in every Python
process CMD starts (`arm_from_env`, called by the injected sitecustomize once torch is imported).

Steps are global: optimizer steps since the training began, across restarts (see detrace.record.steps for
the sources of the numbering and their precedence). A resumed run's records carry the steps of the run that
never stopped, so `detrace diff` compares the two on the steps both have.

`step`, `metric` and `set_step` are no-ops when no tracer is active.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from detrace import _events
from detrace.errors import UsageError
from detrace.record.config import RECORDING_VAR, TraceConfig

__all__ = ["active", "arm_from_env", "checkpoint_io", "metric", "set_step", "step", "trace"]

_tracer = None  # the active detrace.record.session.Tracer, if any
_undo: list[Callable[[], None]] = []


def active() -> object | None:
    """The active Tracer of this process, or None."""
    return _tracer


def _start(config: TraceConfig, *, check_out_dir: bool) -> object:
    global _tracer
    from detrace.defects.arming import arm_from_env as arm_guard_and_fault
    from detrace.digest.kernels import selected_backend, selected_scheme
    from detrace.record.rungs import install
    from detrace.record.session import Tracer
    from detrace.record.steps import step_offset

    arm_guard_and_fault()
    # The variables the tracer reads later, checked now: a bad one refuses the tracer at start in one sentence
    # (the start-up hook prints it and the program runs on), never at its first flush.
    selected_backend()
    selected_scheme()
    step_offset()
    tracer = Tracer(config)
    if check_out_dir:
        tracer.check_out_dir()
    _undo[:] = install(tracer)
    # A sampler registers itself as its iteration starts under this tracer: one of a finished trace has no say.
    _events.sample_source.clear()
    _events.trained_from.clear()
    _tracer, _events.recording = tracer, True
    return tracer


def _stop() -> None:
    global _tracer
    tracer, _tracer, _events.recording = _tracer, None, False
    if tracer is None:
        return
    _events.sample_source.clear()
    _events.trained_from.clear()
    try:
        tracer.close()
    finally:
        for undo in reversed(_undo):
            undo()
        _undo.clear()


def _after_fork_in_child() -> None:
    # A forked child (DataLoader worker, multiprocessing fork) shares the parent's open trace file: it records
    # nothing and never writes to that file.
    if _tracer is not None:
        _tracer.abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _is_torchrun_agent() -> bool:
    """The torchrun / torch.distributed.run agent starts the workers and trains nothing: it writes nothing."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if any(Path(arg).name == "torchrun" for arg in argv[:2]):
        return True
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] in (["torch.distributed.run"],
                                                                  ["torch.distributed.launch"])


def arm_from_env() -> bool:
    """Start the tracer configured by `detrace run` (DETRACE_TRACE); returns whether one was started."""
    config = TraceConfig.from_env()
    if config is None or _tracer is not None:
        return False
    if _is_torchrun_agent():
        # The agent's workers are the job's ranks, whoever started the agent.
        os.environ.pop(RECORDING_VAR, None)
        return False
    _start(config, check_out_dir=False)
    atexit.register(_stop)  # first: whatever follows, the trace is closed at exit
    return True


def on_stop(undo: Callable[[], None]) -> None:
    """Call `undo` when the active tracer stops, after it has closed its trace: what is armed beside the tracer (the
    start-up hook arms `detrace audit`'s probe after it) is taken down with it, the last armed first."""
    if _tracer is None:
        raise UsageError("on_stop needs an active tracer")
    _undo.append(undo)


@contextlib.contextmanager
def trace(out: str | Path, *, rung: str = "metrics", steps: str | Mapping[str, str] = "all", ranks: str = "all",
          max_numel: int | None = None, force: bool = False, capture: str | None = None) -> Iterator[Path]:
    """Record a trace of the code inside the block into run directory `out` (see TraceConfig for the options).

    Inside a process already traced by `detrace run`, the launcher's tracer stays in charge and this block
    records nothing extra. An `out` that already holds a trace is refused unless `force`.
    """
    if _tracer is not None:
        yield Path(_tracer.config.out)
        return
    config = TraceConfig(out=Path(out), rung=rung, steps=steps, ranks=ranks, max_numel=max_numel, force=force,
                         capture=capture)
    _start(config, check_out_dir=True)
    try:
        yield config.out
    finally:
        _stop()


def step(n: int | None = None) -> None:
    """`detrace.step()`: end the current step (for loops without an optimizer; after optimizer.step() it changes
    nothing). `detrace.step(n)`: the step running now is global step `n` (optimizer steps completed since the
    training began, across restarts): call it once after resuming, or at the start of every step."""
    if n is not None:
        set_step(n)
    elif _tracer is not None:
        _tracer.user_step()


def set_step(n: int, *, source: str = "explicit") -> None:
    """Set the step clock to global step `n`, e.g. after resuming from a checkpoint taken after `n` steps.

    `source` names where the number comes from ("train_state", "explicit", "hf", "lightning", ...): it is
    recorded in the trace, and a source never overrides one of higher precedence (TrainState, then explicit
    calls and DETRACE_STEP_OFFSET, then framework integrations, then an optimizer's restored step count)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise UsageError(f"set_step needs a non-negative integer, not {n!r}")
    if not isinstance(source, str) or not source or source == "process":
        raise UsageError(f"set_step needs a source name such as 'explicit' or 'hf', not {source!r}")
    if _tracer is not None:
        _tracer.clock.set_step(n, source)


def metric(name: str, value: float | object) -> None:
    """Record an exact scalar (a Python number or a one-element tensor) in the current step."""
    if _tracer is not None:
        from detrace.record.rungs.metrics import record

        # mypy, ignored below: metric() takes any object; record() refuses a non-scalar with a UsageError
        record(_tracer, name, value)  # type: ignore[arg-type]


def warned(text: str) -> None:
    """An integration warned the user (a stream it cannot resume, a strategy it leaves alone): the trace keeps the
    sentence (the rank's footer, then run.json), so that a verdict can repeat it next to the divergence it may
    explain."""
    if _tracer is not None and text not in _tracer.warnings:
        _tracer.warnings.append(text)


def _checkpoint_running(running: bool) -> None:
    if _tracer is not None:
        with _tracer.clock.lock:
            # max: a tracer started inside a save or load sees its end only
            _tracer.clock.checkpoint_depth = max(0, _tracer.clock.checkpoint_depth + (1 if running else -1))


@contextlib.contextmanager
def checkpoint_io() -> Iterator[None]:
    """Record what runs inside the block (a framework's checkpoint save or load: its collectives, its ops) in phase
    "checkpoint", which `detrace diff` and `check-resume` compare apart from the training: a resumed process loads
    a checkpoint and a continuous one may save one, and neither is a divergence. `detrace.TrainState` enters it by
    itself; integrations enter it around the framework's own save and load."""
    with _events.checkpoint_io():
        yield


def _restore_running(running: bool) -> None:
    if _tracer is not None:
        _tracer.clock.detecting = not running


# A TrainState restored to step n: the clock counts on from n, and the restore itself detects no step.
_events.step_restored.append(lambda n: set_step(n, source="train_state"))
_events.restore_running.append(_restore_running)
_events.checkpoint_running.append(_checkpoint_running)
