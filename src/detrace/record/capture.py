"""The kernel rung's capture: the op call chosen by `--capture` is saved for `detrace replay`.

Inputs are copied before the call (an in-place op overwrites them), outputs after; the file is written with
`detrace.tracefile.save_capture` to `<run>/capture/rank-RRRRR-seqNNNNNNNN.safetensors`. Each process saves at
most one capture: the first call that matches the selector.

The tracer never breaks the traced program: a call that cannot be captured (an argument of a type the capture
format cannot hold, such as a torch.Generator, or a disk that refuses the file) is recorded as impossible in
`<run>/capture/rank-RRRRR-seqNNNNNNNN.impossible.json`, with the reason, and the program goes on.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from detrace._compat import pytree
from detrace.record.records import Call
from detrace.record.session import Tracer
from detrace.tracefile.capture import CODE_HASH, save_capture
from detrace.tracefile.integrity import file_sha256
from detrace.tracefile.layout import capture_path
from detrace.tracefile.writer import write_json_atomic


@dataclass
class PendingCapture:
    """A matching call whose inputs are copied and whose outputs are awaited."""

    call: Call
    args: Any
    kwargs: Any


def _in_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class Capturer:
    """Matches op calls against the selector and saves the first match."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.done = False

    def before(self, call: Call, args: tuple, kwargs: dict) -> PendingCapture | None:
        selector = self.tracer.config.selector
        if self.done or selector is None or (self.tracer.nested and not _in_group()):
            return None  # a capture is a rank's, named after it: a nested process is a rank once in a group
        if not selector.matches(step=call.step, rank=self.tracer.rank, phase=call.phase, module=call.module,
                                name=call.name, occurrence=call.occurrence):
            return None
        self.done = True
        with self.tracer.own():
            copy = pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                                   (tuple(args), dict(kwargs)))
        return PendingCapture(call=call, args=copy[0], kwargs=copy[1])

    def after(self, pending: PendingCapture, out: Any, *, meta: dict[str, Any] | None = None) -> None:
        """Save the call with its outputs; `meta` adds facts about the callee (a compiled kernel's name and code)."""
        tracer = self.tracer
        call = pending.call
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        rank = tracer.rank if tracer.rank is not None else torch.distributed.get_rank() if _in_group() else 0
        assert call.event is not None  # its first record, written before the call ran, set it
        path = capture_path(tracer.config.out, rank, call.event)
        meta = {"rank": rank, "step": call.step, "phase": call.phase, "module": call.module, "name": call.name,
                "occurrence": call.occurrence, "seq": call.event, "threads": torch.get_num_threads(),
                "deterministic": torch.are_deterministic_algorithms_enabled(), **(meta or {})}
        try:
            if "code" in meta:
                # Replay runs this code only on the user's say-so, and only if it is still these exact bytes.
                meta[CODE_HASH] = file_sha256(Path(meta["code"]))
            with tracer.own():
                save_capture(path, op=call.name, args=pending.args, kwargs=pending.kwargs, outputs=outputs,
                             meta=meta)
        except Exception as err:  # whatever the capture hits, the traced program must go on
            reason = str(err) or type(err).__name__
            print(f"detrace: cannot capture {call.name} (seq {call.event}): {reason}; the program goes on",
                  file=sys.stderr)
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(path.with_name(f"{path.stem}.impossible.json"),
                                  {"op": call.name, "reason": reason, "meta": meta})
