"""Collectives and point-to-point: every `torch.distributed` call (sync and async) is wrapped where it is looked up
(`torch.distributed.X` and `torch.distributed.distributed_c10d.X`, which is what FSDP2 and the c10d helpers
call). Inputs are fingerprinted before the call; outputs when the work completes: right after a sync call,
at `Work.wait()` (or when `Work.get_future()` completes) for an async one. Records carry the group's ranks
("0,1"), the call's index in that group on this rank (`group_seq`), the peer for p2p, and the count of
collectives completed before. Nested calls (a helper that calls another collective) are recorded once, at the
outermost call. A collective called inside a region Dynamo compiles is Dynamo's to turn into a functional collective
in the graph, as it does untraced: the wrapper goes straight to the original there, and the functional rung records
the call when the compiled code makes it.

A collective that a training framework makes for itself, outside the backward and the optimizer step (HF
Trainer's logging gather of the loss, Lightning's `self.log(sync_dist=True)`, accelerate's set-up) is recorded in
phase "bookkeeping", with extra {"site": "module:function"}: when a framework makes it differs between a
continuous and a resumed run, and the diff compares such records apart from the training, by identity. A
collective made by torch.distributed.checkpoint (DCP), whoever calls it, is in phase "checkpoint"; any other one
made during an evaluation (detrace.record.rungs.batch) is in phase "evaluation".
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from detrace.record.opaque import Opaque, skip_frames
from detrace.record.patch import replace
from detrace.record.records import recorded_leaves
from detrace.record.rungs.semantic.common import caller, finish, group_name, reentry
from detrace.record.session import Tracer

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


class TracedWork(dist.Work):
    """The Work of an async call, recording its outputs when it completes. It is a real `dist.Work`, so code
    that checks `isinstance(work, dist.Work)` (FSDP2 does) treats it as the original."""

    def __init__(self, inner: dist.Work, completed: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._completed: Callable[[], None] | None = completed

    def _done(self) -> None:
        completed, self._completed = self._completed, None
        if completed is not None:
            completed()

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


def _wrap(tracer: Tracer, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (the collective `name`), recording each call that is not nested in another recorded one."""
    phase, inputs_of, outputs_of, peer_key = _CALLS[name]
    signature = inspect.signature(original)

    @functools.wraps(original, assigned=(), updated=())  # only __wrapped__: inspect sees the original
    def traced(*args: Any, **kwargs: Any) -> Any:
        # Inside a region Dynamo compiles, the original: Dynamo then sees the collective it turns into a functional
        # one in the graph, as untraced (recorded by the functional rung when the compiled code runs it).
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        return recorded(*args, **kwargs)

    def record(*args: Any, **kwargs: Any) -> Any:
        if reentry.active() or not tracer.on["semantic"]:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        group = group_name(arguments.get("group"))
        peer = None
        if peer_key is not None:
            peer = arguments.get(peer_key)
            if peer is None and arguments.get(f"group_{peer_key}") is not None:
                peer = dist.get_global_rank(arguments["group"], arguments[f"group_{peer_key}"])
        found = caller(bookkeeping=tracer.phase in ("forward", "evaluation")) if phase == "collective" else None
        # An evaluation's own collectives and p2p (a metric's all-reduce in the user's loop) are the evaluation's.
        at = found[0] if found else "evaluation" if tracer.phase == "evaluation" else phase
        call = tracer.begin("semantic", at, name, group=group,
                            group_seq=tracer.next_group_seq(group), peer=peer,
                            extra=json.dumps({"site": found[1]}) if found else None)
        before = tracer.snapshot(inputs_of(arguments))
        with reentry.inside():
            result = original(*args, **kwargs)
        if name == "recv" and call.peer is None and isinstance(result, int):
            call.peer = result

        def completed() -> None:
            finish(tracer, call, before, tracer.snapshot(outputs_of(arguments), fresh=True))

        if isinstance(result, dist.Work):
            return TracedWork(result, completed)
        if arguments.get("async_op") or name in ("isend", "irecv"):
            # An async call that returned no Work (coalesced, or not a member of the group): its completion is
            # not observable here, so only its inputs are recorded.
            finish(tracer, call, before, [])
        else:
            completed()
        return result

    recorded = Opaque(record)
    skip_frames(traced)  # run as it is when eager code that Dynamo watches calls it (detrace.record.opaque)
    return traced


def install(tracer: Tracer) -> list[Undo]:
    """Wrap every collective and p2p call in `torch.distributed` and `torch.distributed.distributed_c10d`."""
    undo: list[Undo] = []
    c10d = dist.distributed_c10d
    for name in _CALLS:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        traced = _wrap(tracer, name, original)
        undo.append(replace(c10d, name, traced))
        if getattr(dist, name, None) is original:
            undo.append(replace(dist, name, traced))
    return undo
