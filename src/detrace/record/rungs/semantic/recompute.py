"""Recompute: `torch.utils.checkpoint.checkpoint` (reentrant and not) runs the checkpointed function twice; its
outputs are recorded both times, the second with phase "recompute" and extra {"matches_forward": bool}. While
recording, non-reentrant checkpoints recompute fully (early stop off) so that the recomputed outputs exist; this
changes no value. The function is replaced where it is looked up, `torch.utils.checkpoint.checkpoint`: under
`detrace run` that is before the program imports it; in library form, code that bound it with `from
torch.utils.checkpoint import checkpoint` before the trace started is not seen.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from detrace.record.patch import replace
from detrace.record.records import recorded_leaves
from detrace.record.session import Tracer

Undo = Callable[[], None]


class _Checkpointed:
    """One checkpointed function: its first run is the forward, the next ones recompute it."""

    def __init__(self, tracer: Tracer, fn: Callable[..., Any]) -> None:
        self.tracer = tracer
        self.fn = fn
        self.module = tracer.scope[-1] if tracer.scope else None
        """The module the checkpoint was called in."""
        self.ran = False
        """Whether the forward ran: later runs are recomputations."""
        self.forward: list[int | None] = []
        """The forward's output digests, which a recomputation's are compared to."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = self.tracer
        again, self.ran = self.ran, True
        phase = tracer.phase
        if again:
            tracer.phase = "recompute"
        try:
            out = self.fn(*args, **kwargs)
        finally:
            tracer.phase = phase
        snaps = tracer.snapshot(recorded_leaves(out), now=True)
        digests = [s.digest if s is not None else None for s in snaps]
        if again:
            extra = json.dumps({"matches_forward": digests == self.forward})
            call = tracer.begin("semantic", "recompute", "checkpoint", self.module, extra=extra)
        else:
            self.forward = digests
            call = tracer.begin("semantic", phase, "checkpoint", self.module)
        tracer.emit(call, "output", snaps)
        return out


def install(tracer: Tracer) -> list[Undo]:
    """Replace `torch.utils.checkpoint.checkpoint` by one that records the checkpointed function's outputs."""
    import torch.utils.checkpoint as cp

    original = cp.checkpoint

    @functools.wraps(original, assigned=(), updated=())  # only __wrapped__: inspect sees the original
    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if tracer.on["semantic"]:
            function, kwargs["early_stop"] = _Checkpointed(tracer, function), False
        return original(function, *args, **kwargs)

    return [replace(cp, "checkpoint", checkpoint)]
