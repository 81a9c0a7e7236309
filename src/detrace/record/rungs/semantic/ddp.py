"""DDP: its gradient all-reduce runs in C++ (the Reducer) and never reaches Python's `dist.all_reduce`, so every
DistributedDataParallel built while tracing gets a comm hook at its first forward that records each bucket and
reduces it exactly as the default C++ path does (scale by 1/world_size, then a SUM all-reduce of the bucket).
A comm hook the user registers is wrapped instead; a built-in (C++) comm hook is left alone and unrecorded.
Buckets complete in whatever order the backend finishes them, so their snapshots are kept (input when the hook
runs, output at completion) and recorded at the end of the backward, in bucket index order: records, occurrences
and collective counts come out the same in every run.

Each bucket's record carries its layout, extra {"ddp_bucket": index, "params": [qualified names, in the bucket's
order]}: DDP rebuilds its buckets after a process's first iteration, in the order gradients became ready, so a
resumed process's first step can reduce other buckets than the continuous run's. The diff then says the layout
changed and compares the per-parameter gradients (the optimizer's grad records) instead of the buckets.
"""

# No `from __future__ import annotations` here: DDP checks a comm hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor], which postponed (string) annotations would not equal.

import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

from detrace._compat import DDP_BUILTIN_HOOK_REGISTRAR, current_graph_task_id, queue_backward_callback
from detrace.record.names import named_modules
from detrace.record.patch import replace
from detrace.record.records import Snapshot, recorded_leaves
from detrace.record.rungs.semantic.common import finish, group_name, reentry
from detrace.record.session import Tracer

Undo = Callable[[], None]
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

_NO_TASK = -2
"""No autograd graph task (`current_graph_task_id()` gives -1 outside backward)."""


@dataclass(slots=True)
class _Bucket:
    """A DDP bucket's reduction, kept until the backward ends: its snapshots only, never the bucket."""

    index: int
    group: str
    group_seq: int
    params: list[str]
    """Qualified names of the bucket's parameters, in its order (its layout)."""
    before: list[Snapshot | None] = field(default_factory=list)
    after: list[Snapshot | None] = field(default_factory=list)
    """Empty until the reduction completes."""
    completed: threading.Event = field(default_factory=threading.Event)


class _BucketRecorder:
    """The comm hook of one DDP module: runs `hook` on each bucket and records the bucket's reduction.

    This backward's buckets complete in whatever order gloo (or NCCL) finishes them, so they are recorded once
    the backward is over, all together, in bucket index order: two runs then give the same records in the same
    order, with the same occurrences and collective counts."""

    def __init__(self, tracer: Tracer, ddp: DDP, hook: CommHook) -> None:
        self.tracer = tracer
        self.ddp = ddp
        self.user_hook = hook
        self.buckets: list[_Bucket] = []
        """This backward's buckets, not recorded yet."""
        self.task = _NO_TASK
        """The autograd graph task whose end records `buckets`."""
        self.names: dict[int, str] = {}
        """id(parameter) -> qualified name in the model DDP wraps (taken at the first bucket)."""

    def _record(self, entry: _Bucket) -> None:
        call = self.tracer.begin("semantic", "collective", "all_reduce", group=entry.group,
                                 group_seq=entry.group_seq,
                                 extra=json.dumps({"ddp_bucket": entry.index, "params": entry.params}))
        finish(self.tracer, call, entry.before, entry.after)

    def _record_buckets(self, *, wait: bool = True) -> None:
        done = sorted(self.buckets, key=lambda entry: entry.index)
        self.buckets.clear()
        self.task = _NO_TASK
        for entry in done:
            # The reducer's final callback waited for every bucket already (see _at_backward_end); this
            # wait only guards that ordering. Buckets left by a failed backward are not waited for.
            if wait:
                entry.completed.wait()
            self._record(entry)

    def _at_backward_end(self) -> None:
        # Queued from the first bucket's hook, this runs before the reducer's own final callback (queued
        # after the last bucket's hook), which waits for every bucket and copies them into the gradients.
        # Queuing once more puts the recording after it.
        queue_backward_callback(self._record_buckets)

    def _completed(self, entry: _Bucket, future: torch.futures.Future) -> torch.Tensor:
        result = future.value()
        entry.after = self.tracer.snapshot(recorded_leaves(result), fresh=True)
        self.tracer.forget()  # the reduction wrote the bucket from C++
        entry.completed.set()
        return result

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The comm hook registered with DDP."""
        tracer = self.tracer
        if not tracer.on["semantic"]:
            return self.user_hook(state, bucket)
        group = group_name(self.ddp.process_group)
        if not self.names:
            self.names = {id(p): f"{prefix}.{name}" if prefix else name
                          for prefix, module in named_modules(self.ddp.module)
                          for name, p in module.named_parameters(recurse=False)}
        params = [self.names.get(id(p), "?") for p in bucket.parameters()]
        entry = _Bucket(index=bucket.index(), group=group, group_seq=tracer.next_group_seq(group), params=params)
        # The reducer copied the gradients into the bucket from C++, without bumping its version counter:
        # an earlier snapshot of the same buffer (last step's) must not be reused.
        entry.before = tracer.snapshot([bucket.buffer()], fresh=True)
        with reentry.inside():
            future = self.user_hook(state, bucket)
        current = current_graph_task_id()
        if current == -1:  # not called from a backward (the reducer always is): recorded at completion
            def recorded(done: torch.futures.Future) -> torch.Tensor:
                result = self._completed(entry, done)
                self._record(entry)
                return result

            return future.then(recorded)
        if current != self.task:
            if self.buckets:  # left by a backward that failed before its end: recorded as they are
                self._record_buckets(wait=False)
            queue_backward_callback(self._at_backward_end)
            self.task = current
        self.buckets.append(entry)
        return future.then(lambda done: self._completed(entry, done))


@dataclass(slots=True)
class _Traced:
    """A DDP module built while tracing."""

    first_forward: RemovableHandle
    """The forward pre-hook that gives the module the recording default comm hook, unless it has one by then."""
    comm_hook: str | None = None
    """The comm hook it has: None until one is registered, then "user" (wrapped), "builtin" (C++, unrecorded) or
    "detrace" (the default reduction, registered at the first forward)."""


def _default_hook(ddp: DDP) -> CommHook:
    def reduce(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # The C++ default multiplies each gradient by 1/world_size while copying it into the bucket
        # (at::mul_out with a double scalar), then all-reduces with SUM: the same two steps, the same bits.
        buffer = bucket.buffer()
        buffer.mul_(1.0 / ddp.process_group.size())
        # A nested call of the recording hook: recorded once, as the bucket (see `reentry`).
        work = dist.distributed_c10d.all_reduce(buffer, group=ddp.process_group, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    return reduce


def install(tracer: Tracer) -> list[Undo]:
    """Give every DDP module built while tracing a recording comm hook (see the module's docstring)."""
    original_init = DDP.__init__
    original_register = DDP.register_comm_hook
    original_builtin = getattr(DDP, DDP_BUILTIN_HOOK_REGISTRAR)

    modules: weakref.WeakKeyDictionary[DDP, _Traced] = weakref.WeakKeyDictionary()

    def init(ddp: DDP, *args: Any, **kwargs: Any) -> None:
        original_init(ddp, *args, **kwargs)
        modules[ddp] = _Traced(first_forward=ddp.register_forward_pre_hook(first_forward))

    def first_forward(ddp: DDP, args: Any) -> None:
        traced = modules[ddp]
        traced.first_forward.remove()
        if traced.comm_hook is None:
            original_register(ddp, None, _BucketRecorder(tracer, ddp, _default_hook(ddp)).hook)
            traced.comm_hook = "detrace"

    def register_comm_hook(ddp: DDP, state: object, hook: CommHook) -> None:
        original_register(ddp, state, _BucketRecorder(tracer, ddp, hook).hook)
        if ddp in modules:
            modules[ddp].comm_hook = "user"

    def register_builtin(ddp: DDP, comm_hook_type: Any) -> None:
        original_builtin(ddp, comm_hook_type)
        if ddp in modules:
            modules[ddp].comm_hook = "builtin"

    return [replace(DDP, "__init__", init), replace(DDP, "register_comm_hook", register_comm_hook),
            replace(DDP, DDP_BUILTIN_HOOK_REGISTRAR, register_builtin)]
