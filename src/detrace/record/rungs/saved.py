"""What a run saves last: the tensors of the checkpoint saves made after its last optimizer step, recorded with the
final state as the trace closes (phase "final", role "saved", named "<file name>:<key path>").

A script that changes its model after training (an average, a quantisation, an unseeded draw) and saves it may
free the model before the process ends (a `main()` that returned): the saved file is what the user keeps, so its
tensors are what the diff compares after the last step. Each save's tensors are fingerprinted as it returns (they
may change right after); only the saves made at the latest completed step are kept, and recorded at the end only
if no optimizer step followed them. The checkpoint rung (checkpoints.py) hands every save over.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from detrace.record.records import Snapshot
from detrace.record.session import Tracer


def _tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key path, tensor) of the tensors in dicts, lists and tuples, in their order (objects are not opened)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}.{i}" if path else str(i))


class LastSaves:
    """The saves made at the latest completed step, fingerprinted, until the trace closes."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.completed = -1
        """Optimizer steps completed at the saves kept."""
        self.kept: list[tuple[str, Snapshot | None]] = []
        """(record name, snapshot) of each tensor saved then."""

    def saved(self, obj: Any, paths: list[str], completed: int) -> None:
        """A save of `obj` into `paths` returned with `completed` optimizer steps done."""
        if not self.tracer.enabled or not self.tracer.on.get("semantic"):
            return
        try:
            found = list(_tensors(obj))
            if not found:
                return
            file = os.path.basename(paths[0].rstrip("/")) if paths else "(file object)"
            snaps = self.tracer.snapshot([tensor for _, tensor in found], fresh=True, now=True)
            if completed != self.completed:
                self.completed, self.kept = completed, []
            self.kept += [(f"{file}:{path}", snap) for (path, _), snap in zip(found, snaps, strict=True)]
        except Exception as err:  # a record that cannot be made never fails the program's save
            print(f"detrace: the tensors saved to {paths or 'a file object'} were not recorded: "
                  f"{type(err).__name__}: {err}", file=sys.stderr)

    def record(self, completed: int) -> None:
        """As the trace closes with `completed` optimizer steps done: record the saves made since the last one."""
        if self.completed != completed or not self.tracer.on.get("semantic"):
            return  # a save an optimizer step followed, or a step window that ended before the run did
        step = self.tracer.final_step
        for name, snap in self.kept:
            call = self.tracer.begin("semantic", "final", name)
            call.step = step
            self.tracer.emit(call, "saved", [snap])
