"""At every rung: the checkpoint saves and loads a program makes by itself, with no edit to it.

`torch.save` / `torch.load`, safetensors' `save_file` / `load_file` and `torch.distributed.checkpoint`'s `save` /
`load` (what HF `Trainer`, Lightning, torchtitan and hand-written loops call) run as checkpoint I/O (phase
"checkpoint", compared apart from the training), and each call is logged as it returns, with the optimizer steps
completed and the files it named (detrace.tracefile.checkpoints). safetensors is wrapped at once (transformers
binds its functions when it is imported); torch.distributed.checkpoint, whose import costs a second, only once the
program imported it (looked for as each optimizer step begins, and at install).

Two variables of `detrace check-resume --native` act here:
- DETRACE_NATIVE_STOP_AT=K: the process ends (as a preemption would, its trace complete) when the optimizer step
  after K completed steps begins: after the program's save at step K returned, before anything more is trained.
- DETRACE_NATIVE_CONTROL=skip-optimizer | skip-rng: a negative control applied to what `torch.load` returns: every
  optimizer state dict in it loses its per-parameter state (moments, step counts: a fresh optimizer's), or every
  RNG state in it (torch's CPU generator, Python's `random`, NumPy's) is replaced by this process's own, so that
  restoring it restores nothing.
"""

from __future__ import annotations

import json
import os
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace import _events
from detrace._exit import leave
from detrace.errors import UsageError
from detrace.record.opaque import Opaque
from detrace.record.patch import replace
from detrace.record.rungs.clock import restored_step
from detrace.record.session import Tracer
from detrace.state.contract import ENV_NATIVE_CONTROL as CONTROL_VAR
from detrace.state.contract import ENV_NATIVE_STOP_AT as STOP_VAR
from detrace.state.contract import NATIVE_CONTROLS
from detrace.tracefile.layout import checkpoint_log_path

Undo = Callable[[], None]


def completed_steps(tracer: Tracer) -> int:
    """Optimizer steps completed now: a save in a step's trailing work (after its optimizer step) follows it."""
    clock = tracer.clock
    return clock.step + 1 if clock.trailing else clock.step


def _named(target: Any) -> list[str]:
    """The file a save or load names: a path, or a file object's name; none for a buffer."""
    if isinstance(target, str | os.PathLike):
        return [os.fspath(target)]
    name = getattr(target, "name", None) or getattr(target, "path", None)
    return [name] if isinstance(name, str) else []


def _stop_at() -> int | None:
    text = os.environ.get(STOP_VAR)
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{STOP_VAR} must be a step of at least 1, not {text!r}")
    return int(text)


def _control() -> str | None:
    control = os.environ.get(CONTROL_VAR) or None
    if control is not None and control not in NATIVE_CONTROLS:
        raise UsageError(f"{CONTROL_VAR}={control!r} is not one of {', '.join(NATIVE_CONTROLS)}")
    return control


class _Log:
    """This process's checkpoint log, one JSON line per save or load, written as each returns."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.depth = 0
        """Checkpoint calls running now, in any thread (only the outermost is logged: DCP's writer threads save
        its items with torch.save)."""

    def add(self, op: str, api: str, paths: list[str], control: str | None = None) -> None:
        if not self.tracer.enabled and self.tracer.rank is not None:
            return  # a rank outside the window, or a closed trace
        line = {"op": op, "api": api, "completed": completed_steps(self.tracer), "paths": paths,
                "pid": os.getpid(), "control": control}
        try:
            self.tracer.config.out.mkdir(parents=True, exist_ok=True)  # a process that recorded nothing yet
            with open(checkpoint_log_path(self.tracer.config.out, os.getpid()), "a") as stream:
                stream.write(json.dumps(line) + "\n")
        except OSError as err:  # the training goes on; the run's account of its checkpoints is cut short
            print(f"detrace: the checkpoint log of process {os.getpid()} cannot be written ({err})", file=sys.stderr)


def _wrap(log: _Log, op: str, api: str, function: Callable[..., Any], target: Callable[..., Any],
          transform: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """`function` run as checkpoint I/O and logged; `target(*args, **kwargs)` gives what it names."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if log.depth:  # inside another checkpoint call: that one is logged
            return function(*args, **kwargs)
        log.depth += 1
        try:
            with _events.checkpoint_io():
                result = function(*args, **kwargs)
        finally:
            log.depth -= 1
        control = None
        if transform is not None:
            result, control = transform(result)
        log.add(op, api, _named(target(*args, **kwargs)), control)
        return result

    wrapped.__wrapped__ = function  # type: ignore[attr-defined]
    return wrapped


def _argument(index: int, name: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: kwargs.get(name, args[index] if len(args) > index else None)


def _dcp_target(*args: Any, **kwargs: Any) -> Any:
    for key in ("checkpoint_id", "storage_writer", "storage_reader"):
        value = kwargs.get(key)
        if value is not None:
            return getattr(value, "path", value)
    return None


class _Controls:
    """The negative control of DETRACE_NATIVE_CONTROL, applied to what `torch.load` returns."""

    def __init__(self, tracer: Tracer, control: str | None) -> None:
        self.tracer = tracer
        self.control = control

    def __call__(self, loaded: Any) -> tuple[Any, str | None]:
        if self.control is None:
            return loaded, None
        changed = [False]
        result = self._visit(loaded, changed)
        return result, self.control if changed[0] else None

    def _visit(self, value: Any, changed: list[bool]) -> Any:
        if self.control == "skip-optimizer" and isinstance(value, dict) and {"state", "param_groups"} <= set(value):
            # A fresh optimizer's state; the step count it carried still numbers the steps of the trace.
            self.tracer.restored(restored_step(types.SimpleNamespace(state=value["state"])))
            changed[0] = True
            return {**value, "state": {}}
        if self.control == "skip-rng":
            fresh = _fresh_rng(value)
            if fresh is not None:
                changed[0] = True
                return fresh
        if isinstance(value, dict):
            return {key: self._visit(item, changed) for key, item in value.items()}
        if isinstance(value, list):
            return [self._visit(item, changed) for item in value]
        return value


def _fresh_rng(value: Any) -> Any:
    """This process's own RNG state in place of a saved one (torch's CPU generator, `random`, NumPy's legacy
    global state), or None when `value` is none of them."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        mine = torch.get_rng_state()
        return mine if value.numel() == mine.numel() else None
    if not isinstance(value, tuple) or not value or not isinstance(value[0], int | str):
        return None
    if len(value) == 3 and value[0] == 3 and isinstance(value[1], tuple) and len(value[1]) == 625:
        return random.getstate()
    if len(value) == 5 and value[0] == "MT19937":
        numpy = sys.modules.get("numpy")
        return numpy.random.get_state() if numpy is not None else None
    return None


def install(tracer: Tracer) -> list[Undo]:
    """Wrap the checkpoint functions; under DETRACE_NATIVE_STOP_AT, end the process at the step after it."""
    log = _Log(tracer)
    stop_at = _stop_at()
    controls = _Controls(tracer, _control())
    undo: list[Undo] = [
        replace(torch, "save", _wrap(log, "save", "torch.save", torch.save, _argument(1, "f"))),
        replace(torch, "load", _wrap(log, "load", "torch.load", torch.load, _argument(0, "f"), controls)),
    ]
    try:
        import safetensors.torch as safetensors
    except ImportError:
        pass
    else:
        undo += [
            replace(safetensors, "save_file", _wrap(log, "save", "safetensors.save_file", safetensors.save_file,
                                                    _argument(1, "filename"))),
            replace(safetensors, "load_file", _wrap(log, "load", "safetensors.load_file", safetensors.load_file,
                                                    _argument(0, "filename"))),
        ]
    late: list[Undo] = []

    def wrap_dcp() -> None:
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if late or dcp is None or not hasattr(dcp, "save"):
            return
        late.append(replace(dcp, "save", _wrap(log, "save", "dcp.save", dcp.save, _dcp_target)))
        late.append(replace(dcp, "load", _wrap(log, "load", "dcp.load", dcp.load, _dcp_target)))

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        wrap_dcp()
        if stop_at is not None and tracer.clock.step >= stop_at:
            leave(0)  # the exit handlers close the trace

    def unwrap_dcp() -> None:
        for step in reversed(late):
            step()

    wrap_dcp()
    return [*undo, register_optimizer_step_pre_hook(Opaque(pre)).remove, unwrap_dcp]
