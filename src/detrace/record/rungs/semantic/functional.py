"""Functional collectives (`torch.ops._c10d_functional`, called by torch.distributed._functional_collectives, DTensor
redistribute and the autograd formulas of both, so forward and backward): the op packets are replaced on the
namespace for the life of the tracer, and calls through their `.default` overload (compiled code's way) are
recorded too, once; inputs are fingerprinted before the call, outputs when `wait_tensor` is called on them (or
on a view of them: AsyncCollectiveTensor waits at first use), i.e. at completion. The call runs unchanged;
nothing is added. Inside a region Dynamo compiles, the wrappers go straight to the op, which Dynamo puts in its
graph as untraced; the compiled code then calls the overload, which records.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import torch

from detrace._compat import functional_collectives, op_schema, replace_call, resolve_group, tracing_tensors
from detrace.record.opaque import Opaque, skip_frames
from detrace.record.patch import replace
from detrace.record.records import recorded_leaves
from detrace.record.rungs.semantic.common import finish, group_name, reentry
from detrace.record.session import Tracer

Undo = Callable[[], None]
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

# Op name -> the argument holding the peer of a p2p op. Tensor parallelism (DTensor redistribute) and
# torch.distributed._functional_collectives (all_to_all_single_autograd for expert parallelism) call these, in
# forward and in the backward functions of their autograd formulas.
_FUNCTIONAL: dict[str, str | None] = {
    "all_reduce": None, "all_reduce_": None, "all_reduce_coalesced": None, "all_reduce_coalesced_": None,
    "all_gather_into_tensor": None, "all_gather_into_tensor_out": None, "all_gather_into_tensor_coalesced": None,
    "reduce_scatter_tensor": None, "reduce_scatter_tensor_out": None, "reduce_scatter_tensor_coalesced": None,
    "all_to_all_single": None, "broadcast": None, "broadcast_": None, "isend": "dst", "irecv": "src",
}


_PENDING_LIMIT = 1024
"""Functional collectives awaiting their wait_tensor past which those whose outputs died unwaited are dropped."""


class _TracedOp:
    """Stands in for the op packet `torch.ops._c10d_functional.<name>`: calling it records the call; its overloads
    and other attributes are the packet's own (a call through an overload is recorded by `replace_call`)."""

    def __init__(self, packet: Any, traced: Callable[..., Any]) -> None:
        self._packet = packet
        self._traced = traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._traced(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


skip_frames(_TracedOp.__call__)


class _Awaiting:
    """Functional collectives whose outputs `wait_tensor` has not been called on yet."""

    def __init__(self) -> None:
        self._outputs: dict[int, tuple[weakref.ref[torch.Tensor], set[int], Callable[[], None]]] = {}
        """Storage data pointer of an output -> (the output, the outputs of its call not yet waited on, what
        records the call's completion). A view of an output (AsyncCollectiveTensor waits on views of it) finds
        it through its storage."""

    def add(self, outputs: list[torch.Tensor], completed: Callable[[list[torch.Tensor | None]], None]) -> None:
        """Await `outputs`, one call's; `completed(outputs)` runs when the last is waited on."""
        refs = [weakref.ref(t) for t in outputs]
        waiting = {t.untyped_storage().data_ptr() for t in outputs}
        if len(self._outputs) > _PENDING_LIMIT:  # outputs dropped without a wait
            for key in [key for key, entry in self._outputs.items() if entry[0]() is None]:
                del self._outputs[key]

        def done() -> None:
            completed([ref() for ref in refs])

        for ref, t in zip(refs, outputs, strict=True):
            self._outputs[t.untyped_storage().data_ptr()] = (ref, waiting, done)

    def waited(self, tensor: Any) -> None:
        """`wait_tensor` was called on `tensor`."""
        if not self._outputs or type(tensor) is not torch.Tensor:
            return
        key = tensor.untyped_storage().data_ptr()
        entry = self._outputs.pop(key, None)
        if entry is not None and entry[0]() is not None:
            _, left, done = entry
            left.discard(key)
            if not left:
                done()


class _Recorder:
    """Records the calls of one functional collective, through its packet or its overload."""

    def __init__(self, tracer: Tracer, awaiting: _Awaiting, name: str, schema: Any) -> None:
        self.tracer = tracer
        self.awaiting = awaiting
        self.name = name
        self.names = [argument.name for argument in schema.arguments]
        """The op's argument names, in order: positional arguments are matched to them."""
        self.peer_key = _FUNCTIONAL[name]

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """`run`, recording each call that is not nested in another recorded one."""

        def record(*args: Any, **kwargs: Any) -> Any:
            if reentry.active() or not self.tracer.on["semantic"]:
                return run(*args, **kwargs)
            return self._record(run, args, kwargs)

        recorded = Opaque(record)

        def traced(*args: Any, **kwargs: Any) -> Any:
            # Dynamo puts the op itself in the graph, as untraced; AOTAutograd then traces it with tensors that
            # hold no data (at torch 2.10 outside is_compiling()).
            if torch.compiler.is_compiling() or tracing_tensors(args):
                return run(*args, **kwargs)
            return recorded(*args, **kwargs)

        skip_frames(traced)
        return traced

    def _record(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracer, name, peer_key = self.tracer, self.name, self.peer_key
        arguments = dict(zip(self.names, args, strict=False)) | kwargs
        pg = arguments["group_name"]
        group = group_name(resolve_group(pg) if isinstance(pg, str) else pg)
        peer = arguments.get(peer_key) if peer_key is not None else None
        call = tracer.begin("semantic", "p2p" if peer_key else "collective", name, group=group,
                            group_seq=tracer.next_group_seq(group), peer=peer, extra=json.dumps({"functional": True}))
        inputs = [] if name == "irecv" else recorded_leaves(arguments[self.names[0]])
        before = tracer.snapshot(inputs)
        # Nested: a dispatch mode (the op rung's, DTensor's) that sees the op calls its overload again.
        with reentry.inside():
            result = run(*args, **kwargs)
        outputs = [] if name == "isend" else recorded_leaves(result)
        if not outputs:
            # isend: its completion is not observable here; only its input is recorded.
            finish(tracer, call, before, [])
            return result
        self.awaiting.add(outputs, lambda done: finish(tracer, call, before, tracer.snapshot(done, fresh=True)))
        return result


def _waiting(awaiting: _Awaiting) -> Wrap:
    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def wait_tensor(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = run(tensor, *args, **kwargs)
            if not torch.compiler.is_compiling():  # in a graph Dynamo compiles, the wait alone, as untraced
                waited(tensor)
            return result

        skip_frames(wait_tensor)
        return wait_tensor

    waited = Opaque(awaiting.waited)

    return wrap


def install(tracer: Tracer) -> list[Undo]:
    """Record functional collectives: inputs before the call, outputs when `wait_tensor` is called on them (what
    AsyncCollectiveTensor does at first use), i.e. at completion. Calls through the op packet
    (`torch.ops._c10d_functional.all_reduce(...)`) and through its overload (`....all_reduce.default(...)`) are
    both recorded, once: the packet calls the C++ op, not the overload."""
    ops = functional_collectives()
    awaiting = _Awaiting()
    undo: list[Undo] = []
    for name in _FUNCTIONAL:
        packet = getattr(ops, name, None)
        if packet is not None:
            recorder = _Recorder(tracer, awaiting, name, op_schema(packet.default))
            undo.append(replace(ops, name, _TracedOp(packet, recorder.wrap(packet))))
            undo.append(replace_call(packet.default, recorder.wrap))
    wait_packet = ops.wait_tensor
    waiting = _waiting(awaiting)
    undo.append(replace(ops, "wait_tensor", _TracedOp(wait_packet, waiting(wait_packet))))
    undo.append(replace_call(wait_packet.default, waiting))
    return undo
