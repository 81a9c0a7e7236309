"""Rung 2, module: inputs/outputs of every nn.Module's forward, grad inputs/outputs of its backward.

Global module forward hooks (pre and post) see every module without code changes; the backward is seen through
hooks on the call's output and input tensors (see `_Backward`). Inside a region Dynamo compiles, the hooks
do nothing (they return at once while Dynamo traces them, so the compiled graph is the untraced one); the
region itself is recorded by `detrace.record.rungs.compiled`. Called from eager code that Dynamo watches (the
blocks of a model whose forward Dynamo gave up on, each block compiled alone), a hook is a frame Dynamo would
compile into that same no-op, and the module's records would be lost: Dynamo runs the hooks' frames as they are,
and their recording code with Dynamo off (detrace.record.opaque). A module
is named by its qualified name in its model: the first module called with no module in scope is a root,
and its `named_modules()` names it ("") and everything below (DDP and torch.compile wrappers looked through).
Records: `module` = qualified name, `name` = class name; forward inputs/outputs (roles input/output), backward
gradients (grad_output as the module's backward begins, grad_input when it ends).

The hooks also keep the scope stack (`tracer.scope`) that tells every record below, ops included, its
innermost module, in forward, recompute and backward. They are registered only in steps where the module
rung records, so outside the window they cost nothing.

Backward attribution: the scope stack in the backward follows the tensor hooks, which fire in the order the
engine reaches each module's outputs, not in the order of the nodes that run ops. So every autograd node a
module's forward created is tagged with the module (`Node.metadata`, at the end of the forward: the nodes
between its outputs and its inputs that no inner module tagged first, a custom autograd.Function's included),
and an op run in the backward belongs to the module of the node running it (`owner`); code in the root model's
forward belongs to the root (""). The scope is the fallback for nodes no module created.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from detrace._compat import autograd_sequence_number, current_autograd_node
from detrace.record.names import named_modules
from detrace.record.opaque import Opaque, skip_frames
from detrace.record.records import Call, recorded_leaves
from detrace.record.session import Tracer

Undo = Callable[[], None]

OWNER = "detrace.module"
"""The key of an autograd node's metadata that names the module whose forward created it."""


_REACH = "detrace.module.reach"
"""The key of a module call's output node's metadata that keeps what the walk from that node found (`_walk`)."""


def _tag(outputs: list[torch.Tensor], inputs: list[torch.Tensor], name: str) -> None:
    """Tag with `name` the autograd nodes between a module call's outputs and its inputs that no inner module
    tagged first (inner modules' forwards end first: their nodes carry their own name, and the walk goes on
    through them to the nodes this module's own code created before them).

    The walk goes from each output node separately (`_walk`), so that what it found is known per output node."""
    stops = [t.grad_fn for t in inputs]
    stop_ids = {id(node) for node in stops}
    latest_stop = max((autograd_sequence_number(node) for node in stops), default=-1)
    heads: dict[int, Any] = {id(t.grad_fn): t.grad_fn for t in outputs}  # outputs often share a node
    for key, head in heads.items():
        if key not in stop_ids and head.next_functions:  # returned an input, or a leaf's AccumulateGrad
            _walk(head, stop_ids, latest_stop, name)


def _walk(head: Any, stop_ids: set[int], latest_stop: int, name: str) -> None:
    """Tag with `name` the untagged nodes reachable from `head` without passing a node of `stop_ids` (the call's
    input nodes), and keep on `head` the lowest sequence number of those nodes and the input nodes reached.

    Why it is exact and cheap: an inner call's walk from its output node `o` tagged every node reachable from `o`
    short of the inner call's inputs, and kept (lowest, reached inputs) on `o`. When this walk reaches `o` and
    every one of its own input nodes was created before that lowest node (so none of them lies in `o`'s region,
    where this walk would have stopped), the nodes this walk would find from `o` are exactly that region (all
    tagged already: nothing to do) and what it finds from the inner inputs `o` reached: it jumps there. Otherwise
    it walks through `o` as any node. So nested modules no longer walk their inner modules' nodes once per level,
    and the tags are the same as those of a full walk."""
    # A C++ node's Python object lives only while referenced (at torch 2.10 it is not cached on the node): `kept`
    # holds every node seen, so that the same node keeps its object and no other node's object can take its id.
    kept: list[Any] = [head]
    seen = set(stop_ids)
    reached: dict[int, Any] = {}
    lowest = autograd_sequence_number(head)
    todo: list[Any] = [head]  # Node.metadata is a dict at run time, a method to mypy
    while todo:
        node = todo.pop()
        if node is None:
            continue
        key = id(node)
        if key in seen:
            if key in stop_ids:
                reached[key] = node
            continue  # visited, or the module's input
        if not node.next_functions:
            continue  # a leaf's AccumulateGrad
        kept.append(node)
        seen.add(key)
        metadata = node.metadata
        found = metadata.get(_REACH)
        if found is not None and found[0] > latest_stop:
            lowest = min(lowest, found[0])
            todo += found[1]
            continue
        metadata.setdefault(OWNER, name)
        lowest = min(lowest, autograd_sequence_number(node))
        todo += [child for child, _ in node.next_functions]
    head.metadata[_REACH] = (lowest, tuple(reached.values()))


def owner(phase: str, scope: list[str]) -> str | None:
    """The module of the op running now: in the backward, the module whose forward created the running autograd
    node; else (a recompute, which reruns modules' forwards under their hooks, or an untagged node) the innermost
    module in scope."""
    node = current_autograd_node() if phase == "backward" else None
    if node is not None:
        name = node.metadata.get(OWNER)
        if name is not None:
            return name
    return scope[-1] if scope else None


class ModuleRung:
    """The hooks of the module rung and the names they give."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.roots: list[weakref.ref[nn.Module]] = []
        self.forward_calls: list[Call] = []
        self.handles: list[Any] = []
        self.record_pre = Opaque(self._record_pre, noted=tracer.could_not)
        self.record_post = Opaque(self._record_post, noted=tracer.could_not)

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
                self._scan(ref())  # type: ignore[arg-type]  # alive: the dead refs were dropped on the line above
            name = self.names.get(module)
            if name is None:
                self._scan(module)
                self.roots.append(weakref.ref(module))
                name = self.names[module]
        return name

    # -- hooks ----------------------------------------------------------------------------------------------

    def forward_pre(self, module: nn.Module, args: Any) -> None:
        # Dynamo traces global hooks into the graph it compiles; returning at once (is_compiling() is a constant
        # to it) keeps the graph and its guards as they are untraced. Compiled regions are recorded from their
        # graphs instead (detrace.record.rungs.compiled).
        if not torch.compiler.is_compiling():
            self.record_pre(module, args)

    def _record_pre(self, module: nn.Module, args: Any) -> None:
        tracer = self.tracer
        name = self.name(module)
        tracer.scope.append(name)
        call = tracer.begin("module", tracer.phase, type(module).__name__, name)
        self.forward_calls.append(call)
        tracer.emit(call, "input", tracer.snapshot(recorded_leaves(args, holes=True)))

    def forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self.record_post(module, args, output)

    def _record_post(self, module: nn.Module, args: Any, output: Any) -> None:
        tracer = self.tracer
        if not self.forward_calls:
            return
        call = self.forward_calls.pop()
        if tracer.scope:
            tracer.scope.pop()
        outputs = recorded_leaves(output, holes=True)
        tracer.emit(call, "output", tracer.snapshot(outputs))
        if torch.is_grad_enabled():
            grad_outputs = [t for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            # Leaves are skipped: a hook on a leaf would stay on it for every later step.
            grad_inputs = [t for t in recorded_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if grad_outputs:
                _tag(grad_outputs, grad_inputs, call.module or "")
                _Backward(self.tracer, call, grad_outputs, grad_inputs)

    def switch(self) -> None:
        """Register the hooks in steps where the rung records, remove them elsewhere."""
        on = self.tracer.on["module"]
        if on and not self.handles:
            self.handles = [
                module_hooks.register_module_forward_pre_hook(self.forward_pre),
                module_hooks.register_module_forward_hook(self.forward_post, always_call=True),
            ]
        elif not on and self.handles:
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.forward_calls.clear()
        self.tracer.scope.clear()


class _Backward:
    """One module call's backward, seen through tensor hooks (which, unlike nn.Module full backward hooks, do
    not wrap the module's outputs, so in-place ops on them such as ReLU(inplace=True) keep working).

    It begins when the first gradient w.r.t. an output arrives (grad_output; the module enters the scope) and
    ends when the gradients w.r.t. all its non-leaf inputs have arrived (grad_input; it leaves the scope). A
    module without such inputs (the first layer) stays in scope until the backward of a module containing it
    ends, or the whole backward, so the ops computing its weight gradients still know it. Scopes are kept
    nested by module names (`_enter`, `_leave`), since backward hooks do not fire in nested order."""

    def __init__(self, tracer: Tracer, forward: Call, outputs: list[torch.Tensor],
                 inputs: list[torch.Tensor]) -> None:
        self.tracer = tracer
        self.forward = forward
        self.call: Call | None = None
        self.pending_inputs = len(inputs)
        for index, tensor in enumerate(outputs):
            tensor.register_hook(self._hook("grad_output", index))
        for index, tensor in enumerate(inputs):
            tensor.register_hook(self._hook("grad_input", index))

    def _hook(self, role: str, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            tracer = self.tracer
            if not tracer.on["module"]:
                return
            if self.call is None:
                self.call = tracer.begin("module", "backward", self.forward.name, self.forward.module)
                _enter(tracer.scope, self.forward.module or "")
            tracer.emit(self.call, role, [None] * index + tracer.snapshot([grad]))
            if role == "grad_input":
                self.pending_inputs -= 1
                if self.pending_inputs == 0:
                    _leave(tracer.scope, self.forward.module or "")

        return hook


def _within(entry: str, name: str) -> bool:
    """Whether module `entry` is a submodule of module `name` (qualified names; "" is the root)."""
    return entry != name and (not name or entry.startswith(f"{name}."))


def _enter(scope: list[str], name: str) -> None:
    """A module's backward begins: it goes below the submodules whose backward already began, so the innermost
    module stays last. (A module's output is often its last submodule's output: both grad_output hooks fire on
    that tensor, the submodule's first, since its forward ended first.)"""
    position = len(scope)
    while position and _within(scope[position - 1], name):
        position -= 1
    scope.insert(position, name)


def _leave(scope: list[str], name: str) -> None:
    """A module's backward has ended: remove its own (innermost) entry, and the entries above it of its
    submodules that stayed in scope for want of a grad_input (their backward is part of this one).

    Backward order is not nested: other modules' backward may have begun since this one's (a module whose output
    feeds this module's input gets its grad_output just before this module's grad_input fires, on the same
    tensor), and they stay in scope."""
    for position in range(len(scope) - 1, -1, -1):
        if scope[position] == name:
            break
    else:
        return
    scope[position:] = [entry for entry in scope[position + 1:] if not _within(entry, name)]


skip_frames(ModuleRung.forward_pre)
skip_frames(ModuleRung.forward_post)


def install(tracer: Tracer) -> list[Undo]:
    rung = ModuleRung(tracer)
    tracer.add_listener(rung.switch)
    rung.switch()
    return [rung.remove]
