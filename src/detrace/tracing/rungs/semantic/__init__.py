"""Rung 1, semantic: collectives and point-to-point, DDP/FSDP2 gradient reductions, recompute, the optimizer.

Collectives and p2p: every `torch.distributed` call (sync and async) is wrapped where it is looked up
(`torch.distributed.X` and `torch.distributed.distributed_c10d.X`, which is what FSDP2 and the c10d helpers
call). Inputs are fingerprinted before the call; outputs when the work completes: right after a sync call,
at `Work.wait()` (or when `Work.get_future()` completes) for an async one. Records carry the group's ranks
("0,1"), the call's index in that group on this rank (`group_seq`), the peer for p2p, and the count of
collectives completed before. Nested calls (a helper that calls another collective) are recorded once, at the
outermost call.

Functional collectives (`torch.ops._c10d_functional`, called by torch.distributed._functional_collectives, DTensor
redistribute and the autograd formulas of both, so forward and backward): the op packets are replaced on the
namespace for the life of the tracer, and calls through their `.default` overload (compiled code's way) are
recorded too, once; inputs are fingerprinted before the call, outputs when `wait_tensor` is called on them (or
on a view of them: AsyncCollectiveTensor waits at first use), i.e. at completion.

DDP: its gradient all-reduce runs in C++ (the Reducer) and never reaches Python's `dist.all_reduce`, so every
DistributedDataParallel built while tracing gets a comm hook at its first forward that records each bucket and
reduces it exactly as the default C++ path does (scale by 1/world_size, then a SUM all-reduce of the bucket).
A comm hook the user registers is wrapped instead; a built-in (C++) comm hook is left alone and unrecorded.
Buckets complete in whatever order the backend finishes them, so their snapshots are kept (input when the hook
runs, output at completion) and recorded at the end of the backward, in bucket index order: records, occurrences
and collective counts come out the same in every run.

Recompute: `torch.utils.checkpoint.checkpoint` (reentrant and not) runs the checkpointed function twice; its
outputs are recorded both times, the second with phase "recompute" and extra {"matches_forward": bool}. While
recording, non-reentrant checkpoints recompute fully (early stop off) so that the recomputed outputs exist; this
changes no value. The function is replaced where it is looked up, `torch.utils.checkpoint.checkpoint`: under
`detrace run` that is before the program imports it; in library form, code that bound it with `from
torch.utils.checkpoint import checkpoint` before the trace started is not seen.

Optimizer: grads as the step begins (role grad), then each parameter (role param) and each state tensor
(role state, extra {"state": [keys]} giving the order) after it, named by the parameter's qualified name.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace.tracing.names import parameter_names
from detrace.tracing.patch import replace
from detrace.tracing.session import Call, Snapshot, Tracer, recorded_leaves

Undo = Callable[[], None]
Args = dict[str, Any]


def _arg(key: str) -> Callable[[Args], list[torch.Tensor]]:
    return lambda args: recorded_leaves(args.get(key))


_NONE: Callable[[Args], list[torch.Tensor]] = lambda args: []  # noqa: E731

# name -> (phase, inputs, outputs, peer argument). In-place collectives list the same tensor on both sides:
# the input is fingerprinted before the call, the output after.
_CALLS: dict[str, tuple[str, Callable[[Args], list[torch.Tensor]], Callable[[Args], list[torch.Tensor]],
                        str | None]] = {
    "all_reduce": ("collective", _arg("tensor"), _arg("tensor"), None),
    "all_reduce_coalesced": ("collective", _arg("tensors"), _arg("tensors"), None),
    "all_gather": ("collective", _arg("tensor"), _arg("tensor_list"), None),
    "all_gather_into_tensor": ("collective", _arg("input_tensor"), _arg("output_tensor"), None),
    "_all_gather_base": ("collective", _arg("input_tensor"), _arg("output_tensor"), None),
    "all_gather_single": ("collective", _arg("input_tensor"), _arg("output_tensor"), None),
    "all_gather_coalesced": ("collective", _arg("input_tensor_list"), _arg("output_tensor_lists"), None),
    "reduce_scatter": ("collective", _arg("input_list"), _arg("output"), None),
    "reduce_scatter_tensor": ("collective", _arg("input"), _arg("output"), None),
    "_reduce_scatter_base": ("collective", _arg("input"), _arg("output"), None),
    "reduce_scatter_single": ("collective", _arg("input"), _arg("output"), None),
    "all_to_all": ("collective", _arg("input_tensor_list"), _arg("output_tensor_list"), None),
    "all_to_all_single": ("collective", _arg("input"), _arg("output"), None),
    "broadcast": ("collective", _arg("tensor"), _arg("tensor"), None),
    "reduce": ("collective", _arg("tensor"), _arg("tensor"), None),
    "gather": ("collective", _arg("tensor"), _arg("gather_list"), None),
    "scatter": ("collective", _arg("scatter_list"), _arg("tensor"), None),
    "barrier": ("collective", _NONE, _NONE, None),
    "send": ("p2p", _arg("tensor"), _NONE, "dst"),
    "isend": ("p2p", _arg("tensor"), _NONE, "dst"),
    "recv": ("p2p", _NONE, _arg("tensor"), "src"),
    "irecv": ("p2p", _NONE, _arg("tensor"), "src"),
}

_groups: dict[int, str] = {}

nested = threading.local()
"""`nested.n` > 0 while a recorded collective (or DDP bucket) runs on this thread: the calls it makes are part of
it and are not recorded again."""


def group_name(group: Any) -> str:
    """The global ranks of a process group, e.g. "0,1" (the default group when None)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    name = _groups.get(id(pg))
    if name is None:
        name = _groups[id(pg)] = ",".join(map(str, dist.get_process_group_ranks(pg)))
    return name


class TracedWork(dist.Work):
    """The Work of an async call, recording its outputs when it completes. It is a real `dist.Work`, so code
    that checks `isinstance(work, dist.Work)` (FSDP2 does) treats it as the original."""

    def __init__(self, inner: dist.Work, finish: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._finish: Callable[[], None] | None = finish

    def _done(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._inner.wait(*args, **kwargs)
        self._done()
        return result

    def get_future(self) -> torch.futures.Future:
        def completed(future: torch.futures.Future) -> Any:
            self._done()
            return future.value()

        return self._inner.get_future().then(completed)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def block_current_stream(self) -> None:
        self._inner.block_current_stream()


def _wrap_collective(tracer: Tracer, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    phase, inputs_of, outputs_of, peer_key = _CALLS[name]
    signature = inspect.signature(original)

    def traced(*args: Any, **kwargs: Any) -> Any:
        if getattr(nested, "n", 0) or not tracer.on["semantic"]:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        group = group_name(arguments.get("group"))
        peer = None
        if peer_key is not None:
            peer = arguments.get(peer_key)
            if peer is None and arguments.get(f"group_{peer_key}") is not None:
                peer = dist.get_global_rank(arguments.get("group"), arguments[f"group_{peer_key}"])
        call = tracer.begin("semantic", phase, name, group=group, group_seq=tracer.next_group_seq(group), peer=peer)
        before = tracer.snapshot(inputs_of(arguments))
        nested.n = getattr(nested, "n", 0) + 1
        try:
            result = original(*args, **kwargs)
        finally:
            nested.n -= 1
        if name == "recv" and call.peer is None and isinstance(result, int):
            call.peer = result

        def finish() -> None:
            _finish(tracer, call, before, tracer.snapshot(outputs_of(arguments), fresh=True))

        if isinstance(result, dist.Work):
            return TracedWork(result, finish)
        if arguments.get("async_op") or name in ("isend", "irecv"):
            # An async call that returned no Work (coalesced, or not a member of the group): its completion is
            # not observable here, so only its inputs are recorded.
            _finish(tracer, call, before, [])
        else:
            finish()
        return result

    traced.__wrapped__ = original  # type: ignore[attr-defined]
    return traced


def _finish(tracer: Tracer, call: Call, inputs: list[Snapshot | None], outputs: list[Snapshot | None]) -> None:
    tracer.emit(call, "input", inputs)
    tracer.emit(call, "output", outputs)
    tracer.collective_completed()


def _install_collectives(tracer: Tracer) -> list[Undo]:
    undo: list[Undo] = []
    c10d = dist.distributed_c10d
    for name in _CALLS:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        traced = _wrap_collective(tracer, name, original)
        undo.append(replace(c10d, name, traced))
        if getattr(dist, name, None) is original:
            undo.append(replace(dist, name, traced))
    return undo


# Functional collectives (torch.ops._c10d_functional): op name -> the argument holding the peer of a p2p op.
# Tensor parallelism (DTensor redistribute) and torch.distributed._functional_collectives (all_to_all_single_autograd
# for expert parallelism) call these, in forward and in the backward functions of their autograd formulas.
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
    and other attributes are the packet's own (a call through an overload is recorded by `_trace_overload`)."""

    def __init__(self, packet: Any, traced: Callable[..., Any]) -> None:
        self._packet = packet
        self._traced = traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._traced(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def _trace_overload(overload: Any, trace: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Undo:
    """Record calls through an op overload, `torch.ops._c10d_functional.all_reduce.default(...)`: what compiled
    code (Inductor's output, AOT graphs) and some libraries call. The overload object itself stays in place, its
    class swapped for a subclass whose `__call__` records: code compares overloads by identity (`func is
    ...wait_tensor.default`) and keys tables by them, which a stand-in object would break. `trace(run)` gives
    the recording call of `run`, the overload's own call."""
    cls = type(overload)
    run = functools.partial(cls.__call__, overload)
    traced = trace(run)
    overload.__class__ = type(cls.__name__, (cls,), {
        "__call__": lambda self, /, *args, **kwargs: traced(*args, **kwargs), "__module__": cls.__module__})

    def undo() -> None:
        overload.__class__ = cls

    return undo


def _install_functional(tracer: Tracer) -> list[Undo]:
    """Record functional collectives: inputs before the call, outputs when `wait_tensor` is called on them (what
    AsyncCollectiveTensor does at first use), i.e. at completion. The call runs unchanged; nothing is added.
    Calls through the op packet (`torch.ops._c10d_functional.all_reduce(...)`) and through its overload
    (`....all_reduce.default(...)`) are both recorded, once: the packet calls the C++ op, not the overload."""
    import torch.distributed._functional_collectives  # registers the ops

    ops = torch.ops._c10d_functional
    # storage data pointer of an output -> (the output, outputs not yet waited on, finish); a view of an output
    # (AsyncCollectiveTensor waits on views of it) finds it through its storage.
    pending: dict[int, tuple[weakref.ref[torch.Tensor], set[int], Callable[[], None]]] = {}

    def recording(name: str, schema: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        names = [argument.name for argument in schema.arguments]
        peer_key = _FUNCTIONAL[name]

        def trace(run: Callable[..., Any]) -> Callable[..., Any]:
            def traced(*args: Any, **kwargs: Any) -> Any:
                if getattr(nested, "n", 0) or not tracer.on["semantic"]:
                    return run(*args, **kwargs)
                arguments = dict(zip(names, args, strict=False)) | kwargs
                pg = arguments["group_name"]
                group = group_name(dist.distributed_c10d._resolve_process_group(pg) if isinstance(pg, str) else pg)
                peer = arguments.get(peer_key) if peer_key is not None else None
                call = tracer.begin("semantic", "p2p" if peer_key else "collective", name, group=group,
                                    group_seq=tracer.next_group_seq(group), peer=peer,
                                    extra=json.dumps({"functional": True}))
                inputs = [] if name == "irecv" else recorded_leaves(arguments[names[0]])
                before = tracer.snapshot(inputs)
                # Nested: a dispatch mode (the op rung's, DTensor's) that sees the op calls its overload again.
                nested.n = getattr(nested, "n", 0) + 1
                try:
                    result = run(*args, **kwargs)
                finally:
                    nested.n -= 1
                outputs = [] if name == "isend" else recorded_leaves(result)
                if not outputs:
                    # isend: its completion is not observable here; only its input is recorded.
                    _finish(tracer, call, before, [])
                    return result
                refs = [weakref.ref(t) for t in outputs]

                def finish() -> None:
                    _finish(tracer, call, before, tracer.snapshot([ref() for ref in refs], fresh=True))

                waiting = {t.untyped_storage().data_ptr() for t in outputs}
                if len(pending) > _PENDING_LIMIT:  # outputs dropped without a wait
                    for key in [key for key, entry in pending.items() if entry[0]() is None]:
                        del pending[key]
                for ref, t in zip(refs, outputs, strict=True):
                    pending[t.untyped_storage().data_ptr()] = (ref, waiting, finish)
                return result

            return traced

        return trace

    def waiting(run: Callable[..., Any]) -> Callable[..., Any]:
        def wait_tensor(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = run(tensor, *args, **kwargs)
            if pending and type(tensor) is torch.Tensor:
                key = tensor.untyped_storage().data_ptr()
                entry = pending.pop(key, None)
                if entry is not None and entry[0]() is not None:
                    _, left, finish = entry
                    left.discard(key)
                    if not left:
                        finish()
            return result

        return wait_tensor

    undo: list[Undo] = []
    for name in _FUNCTIONAL:
        packet = getattr(ops, name, None)
        if packet is not None:
            trace = recording(name, packet.default._schema)
            undo.append(replace(ops, name, _TracedOp(packet, trace(packet))))
            undo.append(_trace_overload(packet.default, trace))
    wait_packet = ops.wait_tensor
    undo.append(replace(ops, "wait_tensor", _TracedOp(wait_packet, waiting(wait_packet))))
    undo.append(_trace_overload(wait_packet.default, waiting))
    return undo


@dataclass(slots=True)
class _Bucket:
    """A DDP bucket's reduction, kept until the backward ends: its snapshots only, never the bucket."""

    index: int
    group: str
    group_seq: int
    before: list[Snapshot | None] = field(default_factory=list)
    after: list[Snapshot | None] = field(default_factory=list)
    """Empty until the reduction completes."""
    completed: threading.Event = field(default_factory=threading.Event)


_NO_TASK = -2
"""No autograd graph task (`torch._C._current_graph_task_id()` gives -1 outside backward)."""


def _install_ddp(tracer: Tracer) -> list[Undo]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    engine = torch.autograd.Variable._execution_engine

    original_init = DDP.__init__
    original_register = DDP.register_comm_hook
    original_builtin = DDP._register_builtin_comm_hook

    # The hooks below carry no annotations on purpose: DDP checks them, and this module's postponed (string)
    # annotations would not compare equal to dist.GradBucket / torch.futures.Future.
    def recording(ddp: DDP, hook: Callable[[Any, Any], torch.futures.Future]) -> Callable[..., Any]:
        # This backward's buckets. Their reductions complete in whatever order gloo (or NCCL) finishes them,
        # so they are recorded once the backward is over, all together, in bucket index order: two runs then
        # give the same records in the same order, with the same occurrences and collective counts.
        buckets: list[_Bucket] = []
        task = [_NO_TASK]  # the autograd graph task whose end records `buckets`

        def record(entry: _Bucket) -> None:
            call = tracer.begin("semantic", "collective", "all_reduce", group=entry.group,
                                group_seq=entry.group_seq, extra=json.dumps({"ddp_bucket": entry.index}))
            _finish(tracer, call, entry.before, entry.after)

        def record_buckets(*, wait: bool = True) -> None:
            done = sorted(buckets, key=lambda entry: entry.index)
            buckets.clear()
            task[0] = _NO_TASK
            for entry in done:
                # The reducer's final callback waited for every bucket already (see at_backward_end); this
                # wait only guards that ordering. Buckets left by a failed backward are not waited for.
                if wait:
                    entry.completed.wait()
                record(entry)

        def at_backward_end() -> None:
            # Queued from the first bucket's hook, this runs before the reducer's own final callback (queued
            # after the last bucket's hook), which waits for every bucket and copies them into the gradients.
            # Queuing once more puts the recording after it.
            engine.queue_callback(record_buckets)

        def traced_hook(state, bucket):  # type: ignore[no-untyped-def]
            if not tracer.on["semantic"]:
                return hook(state, bucket)
            group = group_name(ddp.process_group)
            entry = _Bucket(index=bucket.index(), group=group, group_seq=tracer.next_group_seq(group))
            # The reducer copied the gradients into the bucket from C++, without bumping its version counter:
            # an earlier snapshot of the same buffer (last step's) must not be reused.
            entry.before = tracer.snapshot([bucket.buffer()], fresh=True)
            nested.n = getattr(nested, "n", 0) + 1
            try:
                future = hook(state, bucket)
            finally:
                nested.n -= 1

            def completed(future: torch.futures.Future) -> torch.Tensor:
                result = future.value()
                entry.after = tracer.snapshot(recorded_leaves(result), fresh=True)
                tracer.forget()  # the reduction wrote the bucket from C++
                entry.completed.set()
                return result

            current = torch._C._current_graph_task_id()
            if current == -1:  # not called from a backward (the reducer always is): recorded at completion
                return future.then(lambda done: (completed(done), record(entry))[0])
            if current != task[0]:
                if buckets:  # left by a backward that failed before its end: recorded as they are
                    record_buckets(wait=False)
                engine.queue_callback(at_backward_end)
                task[0] = current
            buckets.append(entry)
            return future.then(completed)

        return traced_hook

    def default_hook(ddp: DDP) -> Callable[..., Any]:
        def reduce(state, bucket):  # type: ignore[no-untyped-def]
            # The C++ default multiplies each gradient by 1/world_size while copying it into the bucket
            # (at::mul_out with a double scalar), then all-reduces with SUM: the same two steps, the same bits.
            buffer = bucket.buffer()
            buffer.mul_(1.0 / ddp.process_group.size())
            # A nested call of the recording hook: recorded once, as the bucket (see `nested`).
            work = dist.distributed_c10d.all_reduce(buffer, group=ddp.process_group, async_op=True)
            return work.get_future().then(lambda future: future.value()[0])

        return reduce

    def first_forward(ddp: DDP, args: Any) -> None:
        ddp._detrace_first_forward.remove()
        if getattr(ddp, "_detrace_comm_hook", None) is None:
            original_register(ddp, None, recording(ddp, default_hook(ddp)))
            ddp._detrace_comm_hook = "detrace"

    def init(ddp: DDP, *args: Any, **kwargs: Any) -> None:
        original_init(ddp, *args, **kwargs)
        ddp._detrace_comm_hook = None
        ddp._detrace_first_forward = ddp.register_forward_pre_hook(first_forward)

    def register_comm_hook(ddp: DDP, state: object, hook: Callable[..., Any]) -> None:
        original_register(ddp, state, recording(ddp, hook))
        ddp._detrace_comm_hook = "user"

    def register_builtin(ddp: DDP, comm_hook_type: Any) -> None:
        original_builtin(ddp, comm_hook_type)
        ddp._detrace_comm_hook = "builtin"

    return [replace(DDP, "__init__", init), replace(DDP, "register_comm_hook", register_comm_hook),
            replace(DDP, "_register_builtin_comm_hook", register_builtin)]


def _install_recompute(tracer: Tracer) -> list[Undo]:
    import torch.utils.checkpoint as cp

    def recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
        module = tracer.scope[-1] if tracer.scope else None
        forward: list[int | None] = []
        seen = [False]

        def run(*args: Any, **kwargs: Any) -> Any:
            again = seen[0]
            seen[0] = True
            phase = tracer.phase
            if again:
                tracer.phase = "recompute"
            try:
                out = fn(*args, **kwargs)
            finally:
                tracer.phase = phase
            snaps = tracer.snapshot(recorded_leaves(out), now=True)
            digests = [s.digest if s is not None else None for s in snaps]
            if again:
                extra = json.dumps({"matches_forward": digests == forward})
                call = tracer.begin("semantic", "recompute", "checkpoint", module, extra=extra)
            else:
                forward[:] = digests
                call = tracer.begin("semantic", phase, "checkpoint", module)
            tracer.emit(call, "output", snaps)
            return out

        return run

    original = cp.checkpoint

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if tracer.on["semantic"]:
            function, kwargs["early_stop"] = recorded(function), False
        return original(function, *args, **kwargs)

    checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return [replace(cp, "checkpoint", checkpoint)]


def _install_optimizer(tracer: Tracer) -> list[Undo]:
    names: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, str]] = weakref.WeakKeyDictionary()
    pending: dict[int, tuple[list[torch.Tensor], list[Call]]] = {}

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not tracer.on["semantic"]:
            return
        if optimizer not in names:
            names[optimizer] = parameter_names()
        known = names[optimizer]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        calls = [tracer.begin("semantic", "optimizer", known.get(id(p), f"param{i}")) for i, p in enumerate(params)]
        for call, snap in zip(calls, tracer.snapshot([p.grad for p in params]), strict=True):
            tracer.emit(call, "grad", [snap])
        pending[id(optimizer)] = (params, calls)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        entry = pending.pop(id(optimizer), None)
        if entry is None:
            return
        params, calls = entry
        keys = [sorted(k for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor))
                for p in params]
        tensors = [t for p, ks in zip(params, keys, strict=True) for t in (p, *(optimizer.state[p][k] for k in ks))]
        # fresh: optimizers may write parameters and states through `.data`, which bumps no version counter.
        snaps = iter(tracer.snapshot(tensors, fresh=True))
        for call, ks in zip(calls, keys, strict=True):
            call.extra = json.dumps({"state": ks}) if ks else None
            tracer.emit(call, "param", [next(snaps)])
            tracer.emit(call, "state", [next(snaps) for _ in ks])

    return [register_optimizer_step_pre_hook(pre).remove, register_optimizer_step_post_hook(post).remove]


def install(tracer: Tracer) -> list[Undo]:
    if not dist.is_available():
        return _install_recompute(tracer) + _install_optimizer(tracer)
    return (_install_collectives(tracer) + _install_functional(tracer) + _install_ddp(tracer)
            + _install_recompute(tracer) + _install_optimizer(tracer))
