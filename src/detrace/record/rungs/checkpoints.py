"""At every rung: the checkpoint saves and loads a program makes by itself, with no edit to it.

`torch.save` / `torch.load`, safetensors' `save_file` / `load_file` and `torch.distributed.checkpoint`'s `save` /
`load` (what HF `Trainer`, Lightning, torchtitan and hand-written loops call) run as checkpoint I/O (phase
"checkpoint", compared apart from the training), and each call is logged as it returns, with the optimizer steps
completed and the files it named (detrace.tracefile.checkpoints). safetensors is wrapped at once (transformers
binds its functions when it is imported); torch.distributed.checkpoint, whose import costs a second, once the
program imports it (and at install, and as each optimizer step begins, for a program that imported it first).

A process that loads a checkpoint saved by the stopped run of `detrace check-resume --native` (DETRACE_NATIVE_SAVED:
each file or folder it saved, with its completed steps) counts its steps on from there (detrace.record.steps: the
source "checkpoint"). torch.distributed.checkpoint.state_dict's initialisation of a fresh optimizer's state (an
optimizer step with zero gradients and a zero learning rate) runs as checkpoint I/O: it is not a training step.

Two more variables of `detrace check-resume --native` act here:
- DETRACE_NATIVE_STOP_AT=K: the process ends (as a preemption would, its trace complete) when the optimizer step
  after K completed steps begins: after the program's save at step K returned, before anything more is trained.
- DETRACE_NATIVE_CONTROL=skip-optimizer | skip-rng: a negative control applied to what a load gives the program
  (what `torch.load` and safetensors' `load_file` return, the state dict that `torch.distributed.checkpoint.load`
  fills in place): every optimizer state dict in it loses its per-parameter state (moments, step counts: a fresh
  optimizer's), or every RNG state in it is replaced by this process's own, so that restoring it restores nothing.
  A DCP load of `Stateful` objects (torchtitan's containers) restores them inside the load: no control applies.

RNG states are known by where they came from, never by their shape: the states that `torch.get_rng_state`,
`torch.cuda.get_rng_state(_all)`, `random.getstate` and `numpy.random.get_state` return are remembered (the last
few, by identity), and a save logs where in the saved object they are (their key paths). The skip-rng control
gets those key paths, per file, from the save that wrote it (DETRACE_NATIVE_RNG, set by check-resume from the
stopped run's log) and replaces what is there by this process's state of the same kind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace import _compat, _events
from detrace._exit import leave
from detrace.errors import UsageError
from detrace.record.opaque import Opaque, skip_frames
from detrace.record.patch import after_import, replace
from detrace.record.rungs.checkpoint_files import Files, bytes_of, position
from detrace.record.rungs.clock import restored_step
from detrace.record.rungs.saved import LastSaves
from detrace.record.session import Tracer
from detrace.state.contract import ENV_NATIVE_CONTROL as CONTROL_VAR
from detrace.state.contract import ENV_NATIVE_RNG as RNG_VAR
from detrace.state.contract import ENV_NATIVE_SAVED as SAVED_VAR
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


def _saved_steps() -> dict[str, int]:
    text = os.environ.get(SAVED_VAR)
    if not text:
        return {}
    try:
        given = json.loads(text)
        return {str(path): int(completed) for path, completed in given.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"{SAVED_VAR} is not the saves of check-resume --native ({err})") from err


class _Log:
    """This process's checkpoint log, one JSON line per save or load, written as each returns."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.saved = _saved_steps()
        """The stopped run's saves, by absolute path, with the steps completed at each (DETRACE_NATIVE_SAVED)."""
        self.depth = 0
        """Checkpoint calls running now, in any thread (only the outermost is logged: DCP's writer threads save
        its items with torch.save)."""
        self.files = Files(self.write, str(tracer.config.out))
        """Where the saves end up: renamed, or written from memory into a file."""
        self.last = LastSaves(tracer)
        """The tensors of the saves made at the latest completed step (recorded at the end: saved.py)."""

    def add(self, op: str, api: str, paths: list[str], control: str | None = None,
            rng: list[tuple[str, KeyPath]] | None = None, memory: int | None = None) -> None:
        if op == "load":
            # A file in a folder the stopped run saved (a DCP checkpoint) counts as that folder.
            steps = [self.saved[key] for path in paths for folder in (path, os.path.dirname(path))
                     if (key := os.path.abspath(folder)) in self.saved]
            if steps:
                self.tracer.clock.loaded(steps[0])
        self.files.named(op, paths)
        line = {"op": op, "api": api, "completed": completed_steps(self.tracer), "paths": paths,
                "pid": os.getpid(), "control": control, "rng": rng or []}
        self.write(line if memory is None else {**line, "memory": memory})

    def write(self, line: dict[str, Any]) -> None:
        """Append one line to the log (of a save or load, or of where a save's file went)."""
        if not self.tracer.enabled and self.tracer.rank is not None:
            return  # a rank outside the window, or a closed trace
        try:
            self.tracer.config.out.mkdir(parents=True, exist_ok=True)  # a process that recorded nothing yet
            with open(checkpoint_log_path(self.tracer.config.out, os.getpid()), "a") as stream:
                stream.write(json.dumps(line) + "\n")
        except OSError as err:  # the training goes on; the run's account of its checkpoints is cut short
            print(f"detrace: the checkpoint log of process {os.getpid()} cannot be written ({err})", file=sys.stderr)


def _wrap(log: _Log, op: str, api: str, function: Callable[..., Any], target: Callable[..., Any], *,
          transform: Callable[[Any, list[str]], tuple[Any, str | None]] | None = None, in_place: bool = False,
          saved: Callable[[Any], list[tuple[str, KeyPath]]] | None = None) -> Callable[..., Any]:
    """`function` run as checkpoint I/O and logged; `target(*args, **kwargs)` gives what it names. A load's result
    goes through `transform(result, paths)` (the negative control), or with `in_place` what it loaded into (its
    first argument: DCP fills the state dict it is given); `saved(obj)` finds the RNG states in what a save writes
    (its first argument)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if log.depth:  # inside another checkpoint call: that one is logged
            return function(*args, **kwargs)
        where = target(*args, **kwargs)
        paths = _named(where)
        # A buffer: where a save starts writing into it, what a load reads from it (the call moves its position).
        start = position(where) if op == "save" and not paths else None
        read = bytes_of(where) if op == "load" and not paths else None
        log.depth += 1
        try:
            with _events.checkpoint_io():
                result = function(*args, **kwargs)
        finally:
            log.depth -= 1
        memory = log.files.into_memory(where, start) if start is not None else None
        if read is not None:  # a file of the stopped run's, read into memory first, counts as that file
            paths = log.files.known_file(*read)
        control = None
        if transform is not None and in_place:
            _, control = transform(args[0] if args else kwargs.get("state_dict"), paths)
        elif transform is not None:
            result, control = transform(result, paths)
        rng = saved(args[0] if args else kwargs.get("obj")) if saved is not None else None
        log.add(op, api, paths, control, rng, memory)
        if op == "save":  # its tensors, recorded with the final state if no optimizer step follows (saved.py)
            obj = args[0] if args else next((kwargs[k] for k in ("obj", "tensors", "state_dict") if k in kwargs), None)
            log.last.saved(obj, paths, completed_steps(log.tracer))
        return result

    wrapped.__wrapped__ = function  # type: ignore[attr-defined]
    return wrapped


def _follow(log: _Log, api: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(source, destination, ...)`, a rename: a saved file or folder it moves is logged where it went
    (`shutil.move` returns where that is: into a folder it names, under the source's name)."""

    def wrapped(source: Any, destination: Any, *args: Any, **kwargs: Any) -> Any:
        result = function(source, destination, *args, **kwargs)
        if not args and not any(kwargs.get(fd) is not None for fd in ("src_dir_fd", "dst_dir_fd")):
            try:
                log.files.renamed(api, source, result if api == "shutil.move" and result is not None else destination)
            except Exception as err:  # the program's rename is done: the log's account of it must not undo that
                print(f"detrace: a rename by {api} was not followed in the checkpoint log ({err})", file=sys.stderr)
        return result

    wrapped.__wrapped__ = function  # type: ignore[attr-defined]
    return wrapped


def _as_checkpoint_io(function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _events.checkpoint_io():
            return function(*args, **kwargs)

    return wrapped


def _argument(index: int, name: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: kwargs.get(name, args[index] if len(args) > index else None)


def _dcp_target(*args: Any, **kwargs: Any) -> Any:
    for key in ("checkpoint_id", "storage_writer", "storage_reader"):
        value = kwargs.get(key)
        if value is not None:
            return getattr(value, "path", value)
    return None


KeyPath = list[str | int]
"""Where a value is in a saved object: dict keys and list or tuple indices, from the top."""
_KEPT = 64
"""RNG states remembered by identity (the most recent): a checkpoint saves the ones it just took."""


class _RngStates:
    """Where the RNG states come from: the functions that return them are wrapped, and what they returned last is
    remembered by identity (with a reference, so that no other object takes its id), with its kind."""

    def __init__(self) -> None:
        self.recent: dict[int, tuple[str, Any]] = {}
        self.fresh: dict[str, Callable[[], Any]] = {}
        """Per kind, the original function that gives this process's own state of that kind."""

    def wrap(self, kind: str, function: Callable[[], Any]) -> Callable[[], Any]:
        self.fresh[kind] = function

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # is_compiling() first: Dynamo inlines this into a compiled region (activation checkpointing keeps the
            # RNG state there) and must see the original call alone, so that its graphs are the untraced ones.
            if torch.compiler.is_compiling():
                return function(*args, **kwargs)
            state = function(*args, **kwargs)
            self.recent[id(state)] = (kind, state)
            while len(self.recent) > _KEPT:
                del self.recent[next(iter(self.recent))]
            return state

        wrapped.__wrapped__ = function  # type: ignore[attr-defined]
        skip_frames(wrapped)  # a frame of it that Dynamo would start from (after a graph break) runs as it is
        return wrapped

    def found(self, obj: Any) -> list[tuple[str, KeyPath]]:
        """The RNG states in a saved object, with their key paths (dicts, lists and tuples are looked into)."""
        found: list[tuple[str, KeyPath]] = []

        def visit(value: Any, path: KeyPath) -> None:
            known = self.recent.get(id(value))
            if known is not None and known[1] is value:
                found.append((known[0], path))
            elif isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(key, str | int):
                        visit(item, [*path, key])
            elif isinstance(value, list | tuple):
                for index, item in enumerate(value):
                    visit(item, [*path, index])

        if self.recent:
            visit(obj, [])
        return found


class _Controls:
    """The negative control of DETRACE_NATIVE_CONTROL, applied to what `torch.load` returns."""

    def __init__(self, tracer: Tracer, control: str | None, states: _RngStates) -> None:
        self.tracer = tracer
        self.control = control
        self.states = states
        self.rng: dict[str, list[tuple[str, KeyPath]]] = _rng_paths() if control == "skip-rng" else {}
        """Per file (its absolute path), where the save that wrote it put RNG states (DETRACE_NATIVE_RNG)."""

    def __call__(self, loaded: Any, paths: list[str]) -> tuple[Any, str | None]:
        if self.control == "skip-optimizer":
            return loaded, self.control if self._without_optimizer_state(loaded) else None
        if self.control == "skip-rng":
            found = [item for path in paths for item in self.rng.get(os.path.abspath(path), [])]
            whole = next((kind for kind, key_path in found if not key_path and kind in self.states.fresh), None)
            if whole is not None:  # a file that is one RNG state
                return self.states.fresh[whole](), self.control
            replaced = [self._replace(loaded, key_path, kind) for kind, key_path in found]
            return loaded, self.control if any(replaced) else None
        return loaded, None

    def _without_optimizer_state(self, value: Any) -> bool:
        """Empty every optimizer state dict's per-parameter state in `value`, in place (a loaded checkpoint is the
        program's own fresh object; a DCP state dict is filled in place, then given to the optimizer); whether
        there was one."""
        if isinstance(value, dict) and {"state", "param_groups"} <= set(value):
            # A fresh optimizer's state; the step count it carried still numbers the steps of the trace.
            self.tracer.restored(restored_step(types.SimpleNamespace(state=value["state"])))
            value["state"] = {}
            return True
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        return any([self._without_optimizer_state(item) for item in items])  # (a list: every one of them)

    def _replace(self, loaded: Any, key_path: KeyPath, kind: str) -> bool:
        """Put this process's own state of `kind` at `key_path` (in place: a loaded checkpoint is the program's
        own fresh object); False when the loaded object has nothing there to replace."""
        if kind not in self.states.fresh:
            return False
        holder = loaded
        try:
            for key in key_path[:-1]:
                holder = holder[key]
        except (KeyError, IndexError, TypeError):
            return False
        last = key_path[-1]
        there = (last in holder if isinstance(holder, dict) else
                 isinstance(holder, list) and isinstance(last, int) and 0 <= last < len(holder))
        if not there:
            return False  # (a tuple is not changed in place: its holder would have to be)
        holder[key_path[-1]] = self.states.fresh[kind]()
        return True


def _rng_paths() -> dict[str, list[tuple[str, KeyPath]]]:
    text = os.environ.get(RNG_VAR)
    if not text:
        return {}
    try:
        given = json.loads(text)
        return {str(path): [(str(kind), list(key_path)) for kind, key_path in items] for path, items in given.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"{RNG_VAR} is not the RNG states of check-resume --native ({err})") from err


DCP_MODULES = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict")
"""Wrapped as the program imports them (see `install`)."""
LIGHTNING_IO = ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io")
"""Lightning's checkpoint writers: `_atomic_save(checkpoint, filepath)` saves into a buffer with torch.save and
writes it through fsspec, so the file it names is logged there."""


def install(tracer: Tracer) -> list[Undo]:
    """Wrap the checkpoint functions and the RNG state getters; under DETRACE_NATIVE_STOP_AT, end the process at
    the step after it."""
    log = _Log(tracer)
    stop_at = _stop_at()
    states = _RngStates()
    controls = _Controls(tracer, _control(), states)
    log.files.known += [*log.saved, *controls.rng]  # the stopped run's files: a load from memory may be one
    cuda = torch.cuda
    undo: list[Undo] = [
        replace(torch, "save", _wrap(log, "save", "torch.save", torch.save, _argument(1, "f"), saved=states.found)),
        replace(torch, "load", _wrap(log, "load", "torch.load", torch.load, _argument(0, "f"), transform=controls)),
        *(replace(module, name, states.wrap(kind, getattr(module, name))) for module, name, kind in (
            (torch, "get_rng_state", "torch"), (torch.random, "get_rng_state", "torch"),
            (cuda, "get_rng_state", "cuda"), (cuda.random, "get_rng_state", "cuda"),
            (cuda, "get_rng_state_all", "cuda-all"), (cuda.random, "get_rng_state_all", "cuda-all"),
            (random, "getstate", "python"))),
        # Renames, followed from a saved file to where it is now (Path.replace and .rename, shutil.move call them).
        *(replace(module, name, _follow(log, f"{module.__name__}.{name}", getattr(module, name)))
          for module, name in ((os, "replace"), (os, "rename"), (shutil, "move"))),
    ]
    tracer.add_closing(lambda: log.files.land(final=True))  # a last save into memory, written to a file after it
    tracer.add_closing(lambda: log.last.record(completed_steps(tracer)))
    try:
        import safetensors.torch as safetensors
    except ImportError:
        pass
    else:
        undo += [
            replace(safetensors, "save_file", _wrap(log, "save", "safetensors.save_file", safetensors.save_file,
                                                    _argument(1, "filename"), saved=states.found)),
            replace(safetensors, "load_file", _wrap(log, "load", "safetensors.load_file", safetensors.load_file,
                                                    _argument(0, "filename"), transform=controls)),
        ]
    late: dict[str, list[Undo]] = {}

    def wrap_late() -> None:
        """What the program may import after the tracer started: DCP (a second to import), NumPy, Lightning."""
        dcp = sys.modules.get("torch.distributed.checkpoint")
        if "dcp" not in late and dcp is not None and hasattr(dcp, "save"):
            late["dcp"] = [replace(dcp, "save", _wrap(log, "save", "dcp.save", dcp.save, _dcp_target,
                                                      saved=states.found)),
                           replace(dcp, "load", _wrap(log, "load", "dcp.load", dcp.load, _dcp_target,
                                                      transform=controls, in_place=True))]
        numpy = sys.modules.get("numpy")
        if "numpy" not in late and numpy is not None and hasattr(numpy, "random"):
            late["numpy"] = [replace(numpy.random, "get_state", states.wrap("numpy", numpy.random.get_state))]
        if "init" not in late and (undo_init := _compat.wrap_optimizer_state_init(_as_checkpoint_io)) is not None:
            late["init"] = [undo_init]
        for name in LIGHTNING_IO:
            module = sys.modules.get(name)
            if name not in late and module is not None and hasattr(module, "_atomic_save"):
                late[name] = [replace(module, "_atomic_save", _wrap(log, "save", "lightning._atomic_save",
                                                                    module._atomic_save, _argument(1, "filepath"),
                                                                    saved=states.found))]

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        wrap_late()
        if tracer.clock.checkpoint_depth:
            return  # not a training step (see the module's docstring)
        log.files.land()  # the step's saves into memory are in their files by now
        if stop_at is not None and tracer.clock.step >= stop_at:
            leave(0)  # the exit handlers close the trace

    def unwrap_late() -> None:
        for steps in reversed(late.values()):
            for step in reversed(steps):
                step()

    wrap_late()
    # Wrapped as soon as the program imports them: a resumed process loads before its first optimizer step, and
    # torch's DCP state-dict helpers step a fresh optimizer (not a training step) before that.
    watch = after_import(DCP_MODULES, wrap_late)
    return [*undo, watch, register_optimizer_step_pre_hook(Opaque(pre)).remove, unwrap_late]
