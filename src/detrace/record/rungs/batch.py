"""The input batch, at the semantic rung: the tensors entering the outermost module's forward, per call.

Data enters the model from outside the traced ops (a loader, an augmentation, the labels): when two runs first
differ there, nothing traced computed the difference, and the diff must say "the input batch differs" rather than
blame an op. So every forward call of an outermost module (one called while no module runs on this thread) that
has parameters (a model, not a loss function) records its positional and keyword tensors, in call order, as one
call named "batch" in phase "data", with extra {"module": class name, "args": [argument of each tensor]}. Each
microbatch of a step is one such call (told apart by its occurrence).

`nn.Module.__call__` is replaced for the life of the tracer: a global forward pre-hook would see no keyword
arguments (HF models take the whole batch as keywords) and would move every module call to torch's slow path.
Only forward-phase calls are recorded: a checkpointed block recomputed in backward is no batch. Compiled code
(Dynamo tracing a module call) goes straight to the original, and Dynamo never compiles the wrapper's own frame: a
frame of ours around a compiled module's call would move where Dynamo's graphs begin and break, and with them
Inductor's fusions and the bits (a model with graph breaks ended with other parameters on an AVX-512 CPU).

The same outermost forward call tells the step clock, at every rung, that the next step's work begins: the
trailing work of the step before (what ran after its optimizer step) is over (see detrace.record.steps).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from detrace.record.opaque import Opaque, skip_frames
from detrace.record.patch import replace
from detrace.record.records import recorded_leaves
from detrace.record.session import Tracer


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def record(tracer: Tracer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Record the tensors of one outermost forward call."""
    names: list[str] = []
    tensors: list[Any] = []
    for name, value in [*((str(i), v) for i, v in enumerate(args)), *kwargs.items()]:
        leaves = recorded_leaves(value)
        names += [name] * len(leaves)
        tensors += leaves
    if not tensors:
        return
    extra = json.dumps({"module": type(module).__name__, "args": names})
    call = tracer.begin("semantic", "data", "batch", extra=extra)
    tracer.emit(call, "input", tracer.snapshot(tensors))


def install(tracer: Tracer) -> list[Callable[[], None]]:
    original = nn.Module.__call__
    local = threading.local()

    def begins(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An outermost module call in the forward: a model's begins the step's work, and its tensors are recorded."""
        if tracer.busy or not _has_parameters(module):
            return
        tracer.clock.work_begins()
        if tracer.on["semantic"]:
            record(tracer, module, args, kwargs)

    outermost = Opaque(begins)

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # is_compiling() first: Dynamo inlines this function into compiled regions, and must not trace the rest.
        if torch.compiler.is_compiling() or getattr(local, "inside", False) or not tracer.enabled:
            return original(module, *args, **kwargs)
        local.inside = True
        try:
            if tracer.phase == "forward":
                outermost(module, args, kwargs)
            return original(module, *args, **kwargs)
        finally:
            local.inside = False

    # Dynamo runs the wrapper's frames as they are and compiles the module call inside, where its graphs would begin
    # without detrace (the same code object for every tracer: once per process is enough); the recording runs with
    # Dynamo off (a model called from a compiled function that Dynamo runs eagerly).
    skip_frames(call)
    return [replace(nn.Module, "__call__", call)]
