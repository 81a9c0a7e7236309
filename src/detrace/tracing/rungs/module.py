"""Rung 2, module: inputs/outputs of every nn.Module's forward, grad inputs/outputs of its backward.

Global module hooks (forward pre/post, full backward pre/post) see every module without code changes. A module
is named by its qualified name in its model: the first module called with no module in scope is a root,
and its `named_modules()` names it ("") and everything below (DDP and torch.compile wrappers looked through).
Records: `module` = qualified name, `name` = class name; forward inputs/outputs (roles input/output), backward
gradients (grad_output as the module's backward begins, grad_input when it ends).

The hooks also keep the scope stack (`tracer.scope`) that tells every record below, ops included, its
innermost module, in forward, recompute and backward. They are registered only in steps where the module
rung records, so outside the window they cost nothing.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils import _pytree as pytree

from detrace.tracing.names import named_modules
from detrace.tracing.session import Call, Tracer

Undo = Callable[[], None]


def _tensors(value: Any) -> list[torch.Tensor | None]:
    return [t if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(value)
            if t is None or isinstance(t, torch.Tensor)]


class ModuleRung:
    """The hooks of the module rung and the names they give."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.roots: list[weakref.ref[nn.Module]] = []
        self.forward_calls: list[Call] = []
        self.backward_calls: dict[int, list[Call]] = {}
        self.handles: list[Any] = []

    # -- names ----------------------------------------------------------------------------------------------

    def _scan(self, root: nn.Module) -> None:
        for name, module in named_modules(root):
            self.names[module] = name

    def name(self, module: nn.Module) -> str:
        name = self.names.get(module)
        if name is None:
            # Not known yet: a module added after its root was scanned, or a new root.
            self.roots = [ref for ref in self.roots if ref() is not None]
            for ref in self.roots:
                self._scan(ref())  # type: ignore[arg-type]
            name = self.names.get(module)
            if name is None:
                self._scan(module)
                self.roots.append(weakref.ref(module))
                name = self.names[module]
        return name

    # -- hooks ----------------------------------------------------------------------------------------------

    def forward_pre(self, module: nn.Module, args: Any) -> None:
        tracer = self.tracer
        name = self.name(module)
        tracer.scope.append(name)
        call = tracer.begin("module", tracer.phase, type(module).__name__, name)
        self.forward_calls.append(call)
        tracer.emit(call, "input", tracer.snapshot(_tensors(args)))

    def forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        tracer = self.tracer
        if not self.forward_calls:
            return
        call = self.forward_calls.pop()
        if tracer.scope:
            tracer.scope.pop()
        tracer.emit(call, "output", tracer.snapshot(_tensors(output)))

    def backward_pre(self, module: nn.Module, grad_output: Any) -> None:
        tracer = self.tracer
        name = self.name(module)
        tracer.scope.append(name)
        call = tracer.begin("module", "backward", type(module).__name__, name)
        self.backward_calls.setdefault(id(module), []).append(call)
        tracer.emit(call, "grad_output", tracer.snapshot(_tensors(grad_output)))

    def backward_post(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        tracer = self.tracer
        calls = self.backward_calls.get(id(module))
        if not calls:
            return
        call = calls.pop()
        if call.module in tracer.scope and any(g is not None for g in _tensors(grad_input)):
            # Backward order is not strictly nested (residual branches): drop this module and whatever its
            # backward left above it. A module none of whose inputs needs a gradient (the first layer) gets
            # this call before its own weight gradients are computed, so it stays in scope until the
            # backward ends.
            del tracer.scope[len(tracer.scope) - 1 - tracer.scope[::-1].index(call.module):]
        tracer.emit(call, "grad_input", tracer.snapshot(_tensors(grad_input)))

    def switch(self) -> None:
        """Register the hooks in steps where the rung records, remove them elsewhere."""
        on = self.tracer.on["module"]
        if on and not self.handles:
            self.handles = [
                module_hooks.register_module_forward_pre_hook(self.forward_pre),
                module_hooks.register_module_forward_hook(self.forward_post, always_call=True),
                module_hooks.register_module_full_backward_pre_hook(self.backward_pre),
                module_hooks.register_module_full_backward_hook(self.backward_post),
            ]
        elif not on and self.handles:
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.forward_calls.clear()
        self.backward_calls.clear()
        self.tracer.scope.clear()


def install(tracer: Tracer) -> list[Undo]:
    # Said for every module whose inputs need no gradient (the first layer), on every backward: expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                            "respect to module outputs", category=UserWarning)
    rung = ModuleRung(tracer)
    tracer.add_listener(rung.switch)
    rung.switch()
    return [rung.remove]
