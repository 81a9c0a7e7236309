"""Rung 3, op: every ATen and custom op through a TorchDispatchMode, in forward, backward and optimizer.

Per call: tensor inputs fingerprinted before the call (role input), fresh outputs after (role output), and
every tensor the op writes (in-place `self`, `out=` arguments; role mutated) after. Arguments the op only
writes (`out=`, and `self` of fill_/zero_/copy_/uniform_/normal_/...) are not inputs: their old contents are
often uninitialised memory. `module` is the innermost
module in scope (kept by the module rung's hooks), in the backward the module whose forward created the running
autograd node (`rungs.module.owner`), `phase` the tracer's phase.

Skipped, by rule (the rule is the documented contract, see docs/tracing.md):
1. views and aliases: ops whose schema returns an alias that is not written (view, transpose, slice, detach,
   split, ...): they compute nothing, the data is recorded where it was computed;
2. factories without tensor inputs (zeros, arange, full, ...), unless tagged `nondeterministic_seeded`
   (randn, rand, bernoulli, ...), whose data is computed;
3. ops that return uninitialised memory (empty, empty_like, new_empty, empty_strided, resize_);
4. ops that return no tensor and write none (item, equal, ...);
5. communication ops (namespaces c10d, _c10d_functional, c10d_functional): their outputs are not ready when the
   op returns; the semantic rung records them at completion.

Compiled code: the mode stays out of Dynamo's and Inductor's way (`ignore_compile_internals`), sees the ATen
calls a compiled region makes (extern kernels, fallbacks), and Inductor's own kernels are recorded by
`detrace.record.rungs.compiled`.

The mode is on the dispatch stack only in steps where the op rung records. It runs the op exactly as called and
keeps no tensor: fingerprints are taken at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from detrace._compat import (
    OpOverload,
    TorchDispatchMode,
    current_dispatch_mode,
    op_name,
    op_schema,
    pop_mode,
    push_mode,
)
from detrace.record.capture import Capturer
from detrace.record.rungs.module import owner
from detrace.record.session import Tracer

Undo = Callable[[], None]

_COMMUNICATION = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                            "empty_permuted", "resize_", "resize_as_"})
# In-place ops that overwrite `self` without reading it: its old contents (often uninitialised memory from
# torch.empty, e.g. in nn.Linear's init) are not an input.
_OVERWRITE_SELF = frozenset({"fill_", "zero_", "copy_", "uniform_", "normal_", "random_", "exponential_",
                             "geometric_", "cauchy_", "log_normal_", "bernoulli_"})


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What the rule says about one op overload (computed once per overload)."""

    name: str
    """"aten.index_put_.default"."""
    skip: bool
    seeded: bool
    """Random: recorded even without tensor inputs."""
    written: tuple[tuple[int, str], ...]
    """(position, name) of the arguments the op writes."""
    read: tuple[tuple[int, str], ...]
    """(position, name) of the arguments the op reads: all but `out=` and an overwritten `self`."""
    fresh_outputs: bool
    """The op returns tensors that alias no input."""


def op_info(func: OpOverload) -> OpInfo:
    schema = op_schema(func)
    name = op_name(func)
    views = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    fresh = any(r.alias_info is None for r in schema.returns)
    skip = (func.namespace in _COMMUNICATION or views or func._opname in _UNINITIALISED
            or (not written and not fresh))
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    read = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if not a.is_out and not (i == 0 and func._opname in _OVERWRITE_SELF))
    return OpInfo(name=name, skip=skip, seeded=seeded, written=written, read=read, fresh_outputs=fresh)


def _arguments(which: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors passed for the given schema arguments, in schema order (an op's argument is a tensor or a
    list of optional tensors: no deeper nesting)."""
    tensors: list[torch.Tensor] = []
    for position, name in which:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors += [t for t in value if isinstance(t, torch.Tensor)]
    return tensors


def _results(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned: a tensor, or tuples/lists of them (`_foreach_*`, `_fused_adam`)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out for t in _results(item)] if isinstance(out, (list, tuple)) else []


class OpRecorder(TorchDispatchMode):
    """The dispatch mode of the op rung."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.infos: dict[Any, OpInfo] = {}
        self.capturer = Capturer(tracer) if tracer.config.selector is not None else None
        self.pushed = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, Dynamo refuses to compile while the mode is on the stack and runs the frame eagerly:
        # the traced run would compute other bits than the untraced one. With it, Dynamo and Inductor compile
        # as untraced, and the compiled code's own ATen calls still reach the mode at run time.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        if not tracer.on["op"] or tracer.busy:
            return func(*args, **kwargs)
        info = self.infos.get(func)
        if info is None:
            info = self.infos[func] = op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        inputs = _arguments(info.read, args, kwargs)
        if not inputs and not info.seeded:
            return func(*args, **kwargs)
        call = tracer.begin("op", tracer.phase, info.name, owner(tracer.phase, tracer.scope))
        tracer.emit(call, "input", tracer.snapshot(inputs))
        pending = self.capturer.before(call, args, kwargs) if self.capturer is not None else None
        out = func(*args, **kwargs)
        outputs = _results(out) if info.fresh_outputs else []
        written = _arguments(info.written, args, kwargs)
        # fresh: an in-place op's version counter is bumped only after the call returns through the autograd
        # layers above this mode, so a written tensor still shows the version it had before.
        snaps = tracer.snapshot(outputs + written, fresh=True)
        tracer.emit(call, "output", snaps[: len(outputs)])
        tracer.emit(call, "mutated", snaps[len(outputs):])
        if pending is not None and self.capturer is not None:
            self.capturer.after(pending, out)
        return out

    def switch(self) -> None:
        """On the dispatch stack in steps where the rung records (pushed/popped by the thread that ends steps)."""
        on = self.tracer.on["op"]
        if on and not self.pushed:
            push_mode(self)
            self.pushed = True
        elif not on and self.pushed and current_dispatch_mode() is self:
            # A mode the program pushed above ours keeps ours underneath; it then passes calls through.
            pop_mode()
            self.pushed = False

    def remove(self) -> None:
        if self.pushed and current_dispatch_mode() is self:
            pop_mode()
            self.pushed = False


def install(tracer: Tracer) -> list[Undo]:
    recorder = OpRecorder(tracer)
    tracer.add_listener(recorder.switch)
    recorder.switch()
    return [recorder.remove]
