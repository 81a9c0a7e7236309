"""Compiled regions (`torch.compile`): each Dynamo graph as a record of its own, and Inductor's kernels inside it.

A compiled region runs no module hook and no dispatch-mode call for what Inductor fused into its kernels, so
the other rungs would see it as one opaque call. This module records it from the compiled artifacts, without
changing what Dynamo traces or Inductor generates:

- **Regions** (semantic rung and up). The callable Dynamo gets from its backend for each graph is wrapped
  (`OutputGraph.call_user_compiler`): its inputs are recorded before the call and its outputs after, as one call
  named `compiled_graph`, under the module that owns the graph (the `self` of the compiled frame that calls it;
  else the innermost module in scope), with `extra: {"compile_id": "0/1"}`. Its backward (AOTAutograd's backward
  graph, the `CompiledFunctionBackward` node of the outputs) is recorded through hooks on that node: the
  gradients w.r.t. the graph's outputs as it begins (role `grad_output`), w.r.t. its inputs as it ends
  (`grad_input`). While a region runs, its module is in scope, so op records inside it name it.
- **Kernels** (op rung). Every Python module Inductor loads as a graph's output code (`PyCodeCache`, fresh
  compile or cache hit) has its C++ kernels (`cpp_fused_*`) replaced by wrappers: in steps where the op rung
  records, a kernel's input buffers are fingerprinted before it runs and the buffers it writes after (roles
  input, output, and mutated for `in_out_ptr` buffers), as one op call named `inductor.<kernel>` with `extra:
  {"kernel": ..., "aten": [the ATen ops it was lowered from], "code": the output code file}`. These are the
  kernel's real bits, not an eager re-execution. Outside the window a wrapper only checks a flag. ATen calls the
  output code makes (`extern_kernels.mm`, fallbacks) reach the op rung's dispatch mode, which
  `ignore_compile_internals` keeps out of Dynamo's way. An `in_out_ptr` buffer is often one the output code has
  just allocated uninitialized (`empty_strided_cpu`), which the kernel writes before it reads: its old contents
  are whatever the allocator left there, which differ between two runs of the same program whenever the
  allocator's history does (on a busy machine, nearly always). So that a kernel's recorded input is never
  garbage, the output code's uninitialized buffers are zero-filled while the op rung records (as
  `torch.utils.deterministic.fill_uninitialized_memory` fills ATen's); a kernel that reads only what it wrote
  computes the same bits either way.

The patches are put in place the first time the program calls `torch.compile` (or at install when Dynamo is
already imported), so a program that never compiles does not import Dynamo (detrace.record.opaque).
"""

from __future__ import annotations

import json
import re
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from detrace import _compat
from detrace._numbers import parse_count
from detrace.record.capture import Capturer
from detrace.record.names import named_modules, roots
from detrace.record.opaque import when_compiling
from detrace.record.records import recorded_leaves
from detrace.record.rungs.module import owner
from detrace.record.session import Tracer

Undo = Callable[[], None]

REGION = "compiled_graph"
"""The `name` of a compiled region's records."""
KERNEL_PREFIX = "inductor."
"""Kernel records are named `inductor.<kernel name>`."""

_active: list[CompiledRecorder] = []
"""The recorder of the active tracer, if any. Wrappers outlive a tracer (Dynamo keeps compiled regions, Inductor
keeps loaded output code), so they look it up at each call: a later trace in the same process records through
them, and with no tracer they only call through."""

_KERNEL = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\]), r'''(.*?)'''\)", re.M | re.S)
_SIGNATURE = re.compile(r'extern "C"\s+void\s+kernel\(([^)]*)\)')


def aten_ops(kernel: str) -> list[str]:
    """The ATen ops a kernel was lowered from, read from its name: Inductor names fused kernels after their
    original ATen ops (`cpp_fused_expand_index_put_new_zeros_sum_1` -> aten.expand, aten.index_put,
    aten.new_zeros, aten.sum); the longest op name wins at each position."""
    words = kernel.split("_")
    for prefix in (("cpp", "fused"), ("cpp",), ("triton", "poi", "fused"), ("triton", "red", "fused"),
                   ("triton", "per", "fused")):
        if tuple(words[:len(prefix)]) == prefix:
            words = words[len(prefix):]
            break
    if words and parse_count(words[-1]) is not None:
        words = words[:-1]
    found: list[str] = []
    i = 0
    while i < len(words):
        for j in range(len(words), i, -1):
            name = "_".join(words[i:j])
            if hasattr(torch.ops.aten, name):
                found.append(f"aten.{name}")
                i = j
                break
        else:
            i += 1
    return found


def _span(tensor: torch.Tensor) -> torch.Tensor:
    """The memory a kernel addresses through a buffer's data pointer: a 1-d view from that pointer to the
    buffer's last element (a kernel indexes raw memory, so the buffer's shape and strides do not matter to it)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)) \
        if tensor.numel() else 0
    return tensor.as_strided((extent,), (1,))


class _Kernel:
    """Stands in for one C++ kernel of an output code module (see the module docstring)."""

    def __init__(self, name: str, kernel: Callable[..., Any], params: list[str], code: str) -> None:
        self.kernel = kernel
        self.record_name = KERNEL_PREFIX + name
        self.aten = aten_ops(name)
        self.extra = json.dumps({"kernel": name, "aten": self.aten, "code": code})
        self.code = code
        self.name = name
        # Inductor names a kernel's pointer parameters in_ptrN (read), out_ptrN (written) and in_out_ptrN.
        self.reads = [i for i, p in enumerate(params) if p.startswith(("in_ptr", "in_out_ptr"))]
        self.outputs = [i for i, p in enumerate(params) if p.startswith("out_ptr")]
        self.mutated = [i for i, p in enumerate(params) if p.startswith("in_out_ptr")]

    def __call__(self, *args: Any) -> Any:
        if not _active or not _active[0].tracer.on["op"] or _active[0].tracer.busy:
            return self.kernel(*args)
        recorder = _active[0]
        tracer = recorder.tracer
        # In the backward: the module whose forward created the running node, the compiled region's owner.
        call = tracer.begin("op", tracer.phase, self.record_name, owner(tracer.phase, tracer.scope), extra=self.extra)
        # fresh: kernels write through raw pointers, which bump no version counter.
        tracer.emit(call, "input", tracer.snapshot([args[i] for i in self.reads], fresh=True))
        capturer = recorder.capturer
        pending = None
        if capturer is not None:
            spans = [_span(a) if isinstance(a, torch.Tensor) else a for a in args]
            pending = capturer.before(call, tuple(spans), {})
        out = self.kernel(*args)
        tracer.forget()
        written = [args[i] for i in self.outputs + self.mutated]
        snaps = tracer.snapshot(written, fresh=True)
        tracer.emit(call, "output", snaps[: len(self.outputs)])
        tracer.emit(call, "mutated", snaps[len(self.outputs):])
        if pending is not None and capturer is not None:
            capturer.after(pending, [_span(args[i]) for i in self.outputs + self.mutated],
                           meta={"kernel": self.name, "code": self.code, "writes": self.outputs + self.mutated,
                                 "aten": self.aten})
        return out


class _Region:
    """Stands in for the callable a backend compiled one Dynamo graph into (see the module docstring)."""

    def __init__(self, compiled: Callable[..., Any], owner: nn.Module | None, compile_id: str) -> None:
        self.compiled = compiled
        self.owner = weakref.ref(owner) if owner is not None else None
        self.extra = json.dumps({"compile_id": compile_id})

    def module(self, recorder: CompiledRecorder) -> str | None:
        owner = _calling_module()
        if owner is None and self.owner is not None:
            owner = self.owner()
        if owner is not None:
            return recorder.name(owner)
        scope = recorder.tracer.scope
        return scope[-1] if scope else None

    def __call__(self, *args: Any) -> Any:
        if not _active or not _active[0].tracer.on["semantic"] or _active[0].tracer.busy:
            return self.compiled(*args)
        recorder = _active[0]
        tracer = recorder.tracer
        module = self.module(recorder)
        call = tracer.begin("semantic", tracer.phase, REGION, module, extra=self.extra)
        tracer.emit(call, "input", tracer.snapshot(recorded_leaves(list(args), holes=True)))
        tracer.scope.append(module or "")
        try:
            out = self.compiled(*args)
        finally:
            _pop(tracer.scope, module or "")
        outputs = recorded_leaves(out, holes=True)
        tracer.emit(call, "output", tracer.snapshot(outputs, fresh=True))
        if torch.is_grad_enabled():
            for node in _backward_nodes(outputs):
                self._hook_backward(tracer, node, module)
        return out

    def _hook_backward(self, tracer: Tracer, node: Any, module: str | None) -> None:
        calls: list[Any] = []

        def pre(grad_outputs: tuple[Any, ...]) -> None:
            if not tracer.on["semantic"]:
                return
            call = tracer.begin("semantic", "backward", REGION, module, extra=self.extra)
            calls.append(call)
            tracer.emit(call, "grad_output", tracer.snapshot(list(grad_outputs), fresh=True))
            tracer.scope.append(module or "")

        def post(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if not calls:
                return
            call = calls.pop()
            _pop(tracer.scope, module or "")
            tracer.emit(call, "grad_input", tracer.snapshot(list(grad_inputs), fresh=True))

        node.register_prehook(pre)
        node.register_hook(post)


_FRAMES = 8
"""Frames looked up for the module whose code calls a region (Dynamo's wrappers sit in between)."""


def _calling_module() -> nn.Module | None:
    """The module whose compiled frame calls the region now: the `self` of the nearest calling frame that has a
    module as `self`. Dynamo reuses a graph for every instance of a module class (the blocks of a model), so the
    module it was compiled for is not always the one running it."""
    frame: FrameType | None = sys._getframe(3)  # past this function, _Region.module and _Region.__call__
    for _ in range(_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            return owner
        frame = frame.f_back
    return None


def _pop(scope: list[str], name: str) -> None:
    """Remove the innermost entry `name` from the scope (entries other hooks pushed since stay)."""
    for position in range(len(scope) - 1, -1, -1):
        if scope[position] == name:
            del scope[position]
            return


def _backward_nodes(outputs: list[Any]) -> list[Any]:
    """The autograd nodes of AOTAutograd's compiled backward behind a region's outputs (an output that aliases
    another is a view node whose input is that node)."""
    nodes: dict[int, Any] = {}
    for tensor in outputs:
        node = tensor.grad_fn if isinstance(tensor, torch.Tensor) else None
        for candidate in (node, *(n for n, _ in getattr(node, "next_functions", ()) or ())):
            if candidate is not None and "CompiledFunction" in candidate.name():
                nodes.setdefault(id(candidate), candidate)
                break
    return list(nodes.values())


class CompiledRecorder:
    """The patches of this module and the names of the modules owning compiled graphs."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.capturer = Capturer(tracer) if tracer.config.selector is not None else None
        self.undo: list[Undo] = []
        self.patched = False

    def name(self, module: nn.Module) -> str:
        """A module's qualified name in its model (found once among the live root modules)."""
        name = self.names.get(module)
        if name is None:
            for root in roots():
                for qualified, found in named_modules(root):
                    self.names.setdefault(found, qualified)
            name = self.names.setdefault(module, "")
        return name

    def patch(self) -> None:
        """Wrap Dynamo's backend results and (op rung) Inductor's output code; imports both."""
        if self.patched:
            return
        self.patched = True
        self.undo.append(_compat.wrap_compiled_graphs(
            lambda compiled, owner, compile_id: _Region(compiled, owner if isinstance(owner, nn.Module) else None,
                                                        compile_id)))
        if self.tracer.config.rung == "op":
            self.undo.append(_compat.wrap_output_code(instrument))

    def remove(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
        if self in _active:
            _active.remove(self)


class _ZeroFilled:
    """Stands in for an output code module's `empty_strided_<device>` allocator: while the op rung records, the
    buffer comes zero-filled, so that a kernel's recorded `in_out_ptr` input is never uninitialized memory (see
    the module docstring)."""

    def __init__(self, allocate: Callable[..., torch.Tensor]) -> None:
        self.allocate = allocate

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        buffer = self.allocate(*args, **kwargs)
        if _active and _active[0].tracer.on["op"]:
            buffer.zero_()
        return buffer


def instrument(module: Any) -> None:
    """Wrap the C++ kernels of one output code module, and its allocators of uninitialized buffers (once)."""
    if getattr(module, "_detrace_kernels", False) or not callable(getattr(module, "call", None)):
        return
    module._detrace_kernels = True
    for name, allocate in list(module.__dict__.items()):
        if name.startswith("empty_strided") and callable(allocate):
            module.__dict__[name] = _ZeroFilled(allocate)
    path = getattr(module, "__file__", None)
    try:
        source = Path(path).read_text() if path else ""
    except OSError:
        return
    for match in _KERNEL.finditer(source):
        name = match.group(1)
        signature = _SIGNATURE.search(match.group(3))
        kernel = module.__dict__.get(name)
        if signature is None or kernel is None or isinstance(kernel, _Kernel):
            continue
        params = [p.strip().split()[-1].lstrip("*") for p in signature.group(1).split(",") if p.strip()]
        module.__dict__[name] = _Kernel(name, kernel, params, str(path))


def install(tracer: Tracer) -> list[Undo]:
    recorder = CompiledRecorder(tracer)
    _active[:] = [recorder]
    return [recorder.remove, *when_compiling(recorder.patch)]
