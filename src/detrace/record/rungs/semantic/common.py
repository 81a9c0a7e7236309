"""What the semantic recorders share: the process group's name, the re-entry guard, and closing a recorded call."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch.distributed as dist

from detrace._compat import default_group
from detrace.record.records import Call, Snapshot
from detrace.record.session import Tracer

_groups: dict[int, str] = {}


def group_name(group: Any) -> str:
    """The global ranks of a process group, e.g. "0,1" (the default group when None)."""
    pg = group if group is not None else default_group()
    name = _groups.get(id(pg))
    if name is None:
        name = _groups[id(pg)] = ",".join(map(str, dist.get_process_group_ranks(pg)))
    return name


class _Reentry(threading.local):
    """How many recorded collectives (or DDP buckets) are running on this thread. The calls one makes (a helper
    that calls another collective, a dispatch mode that calls the op's overload again, the DDP hook's own
    all-reduce) are part of it and are not recorded again."""

    depth = 0

    def active(self) -> bool:
        """Whether a recorded call is running on this thread: the call being made is nested in it."""
        return self.depth > 0

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Run the body as a recorded call: calls made within it are nested."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


reentry = _Reentry()

FRAMEWORKS = ("transformers.", "accelerate.", "lightning.", "pytorch_lightning.", "lightning_fabric.", "torchmetrics.")
"""Packages whose own collectives (logging gathers, metric syncs, set-up, their checkpoints) are bookkeeping."""
_MODEL_CODE = ("transformers.models.", "transformers.modeling_")
"""Model code inside a framework package: its collectives (FSDP's gathers in a forward) are training."""
_CHECKPOINT = "torch.distributed.checkpoint"
"""DCP: its collectives (planning, gathering the metadata) are checkpoint I/O, whoever calls it."""
_PASSED = ("torch", "detrace", "contextlib", "functools")
"""Modules looked through to find who made a collective."""


def caller(*, bookkeeping: bool) -> tuple[str, str] | None:
    """(phase, "module:function") for a collective being called now that is not training: ("checkpoint", ...)
    when DCP makes it; with `bookkeeping`, ("bookkeeping", ...) when its innermost caller outside torch (and
    detrace, and the standard decorators) is a training framework's own code (not model code). None for anything
    else: the user's loop, a model's forward, an autograd hook."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_CHECKPOINT):
            return "checkpoint", f"{module}:{frame.f_code.co_name}"
        if module.split(".", 1)[0] not in _PASSED:
            if bookkeeping and module.startswith(FRAMEWORKS) and not module.startswith(_MODEL_CODE):
                return "bookkeeping", f"{module}:{frame.f_code.co_name}"
            return None
        frame = frame.f_back
    return None


def finish(tracer: Tracer, call: Call, inputs: list[Snapshot | None], outputs: list[Snapshot | None]) -> None:
    """Record a collective's inputs and outputs, and count it as completed."""
    tracer.emit(call, "input", inputs)
    tracer.emit(call, "output", outputs)
    tracer.collective_completed()
