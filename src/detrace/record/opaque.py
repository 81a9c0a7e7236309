"""What Dynamo sees of the tracer: nothing it would compile.

The tracer's hooks and replaced functions run inside programs that `torch.compile` some of their code, and Dynamo
traces what a compiled frame calls: a global optimizer hook inside a compiled `optimizer.step`, the replaced
`torch.autograd.backward` inside a compiled training step. Traced, the recording code would be compiled into the
user's graph, or fail to compile (it fingerprints through NumPy) and stop the user's program with Dynamo's error.
So:

- `Opaque(fn)`, for a hook or a replaced function: Dynamo does not trace it. Called from a compiled frame, it is a
  graph break, and `fn` runs eagerly with Dynamo off in everything it calls (`torch.compiler.disable`); called
  from eager code, it is one Python call more.
- `skip_frames(fn)`, for a wrapper that must stay inlinable (the batch recorder's `nn.Module.__call__`, which
  goes straight to the original while Dynamo traces, so that the graph is the untraced one): Dynamo runs its
  frames as they are and compiles the frames they call, where its graphs would begin without detrace.

Both take effect once Dynamo is imported: at once, or at the program's first `torch.compile` (`when_compiling`),
so that a program that never compiles never imports Dynamo (a second of start-up).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from detrace import _compat
from detrace.record.patch import replace

Undo = Callable[[], None]

_waiting: weakref.WeakSet[Opaque] = weakref.WeakSet()
"""The Opaque callables made before Dynamo was imported, hidden at the first `torch.compile`."""
_skipped: set[CodeType] = set()
"""The code objects Dynamo must run as they are, registered before Dynamo was imported (each tracer registers its
wrappers again: the same code objects, kept once)."""


class Opaque:
    """`fn`, which Dynamo never traces (see the module docstring). With `noted` (a hook that only records, such as
    the tracer's `could_not`), an exception of `fn` is handed to `noted(1, err)` and the hook returns None: a record
    that cannot be made never reaches the program."""

    def __init__(self, fn: Callable[..., Any], *, noted: Callable[[int, BaseException], None] | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.call = fn
        self.noted = noted
        if _compat.dynamo_imported():
            self._hide()
        else:
            _waiting.add(self)

    def _hide(self) -> None:
        self.call = torch.compiler.disable(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.noted is None:
            return self.call(*args, **kwargs)
        try:
            return self.call(*args, **kwargs)
        except Exception as err:  # the tracer's own failure: noted, never raised in the program
            self.noted(1, err)
            return None


def skip_frames(fn: Callable[..., Any]) -> None:
    """Have Dynamo run `fn`'s frames as they are and compile the frames they call (see the module docstring)."""
    if _compat.dynamo_imported():
        _compat.dynamo_skips(fn.__code__)
    else:
        _skipped.add(fn.__code__)


skip_frames(Opaque.__call__)  # a frame of Opaque's own is a plain call


def _hide_all() -> None:
    while _skipped:
        _compat.dynamo_skips(_skipped.pop())
    for opaque in list(_waiting):
        opaque._hide()
    _waiting.clear()


def when_compiling(action: Callable[[], None]) -> list[Undo]:
    """Run `action` now if Dynamo is imported, else the first time the program calls `torch.compile`; returns the
    undo callables."""
    if _compat.dynamo_imported():
        action()
        return []
    original = torch.compile

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        action()
        return original(*args, **kwargs)

    return [replace(torch, "compile", compile)]


def install() -> list[Undo]:
    """Hide the tracer's hooks from Dynamo once it is imported (call after every rung is installed)."""
    return when_compiling(_hide_all)
