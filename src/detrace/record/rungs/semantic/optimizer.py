"""Optimizer: grads as the step begins (role grad), then each parameter (role param) and each state tensor
(role state, extra {"state": [keys]} giving the order) after it, named by the parameter's qualified name; then
every buffer of the models the optimizer trains (role buffer, named by its qualified name). Buffers are model state
that no optimizer writes (BatchNorm statistics, counters, EMA copies, an MoE router's load statistics): recorded
with the parameters, a buffer that differs between two runs is a divergence like a parameter that does.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace.record.names import buffers, owners, parameter_names
from detrace.record.opaque import Opaque
from detrace.record.records import Call
from detrace.record.session import Tracer

Undo = Callable[[], None]


class _StepRecorder:
    """The global optimizer step hooks: grads before the step, parameters and states after it."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, str]] = weakref.WeakKeyDictionary()
        """Each optimizer's parameter names, by parameter id, taken at its first step."""
        self.models: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[weakref.ref[torch.nn.Module]]] = (
            weakref.WeakKeyDictionary())
        """The root modules that hold each optimizer's parameters, found at its first step."""
        self.pending: dict[int, tuple[list[torch.Tensor], list[Call]]] = {}
        """Optimizer id -> its parameters and their calls, from the pre-hook to the post-hook of a step."""

    def pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tracer = self.tracer
        if not tracer.on["semantic"]:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if optimizer not in self.names:
            self.names[optimizer] = parameter_names()
            self.models[optimizer] = [weakref.ref(model) for model in owners({id(p) for p in params})]
        known = self.names[optimizer]
        calls = [tracer.begin("semantic", "optimizer", known.get(id(p), f"param{i}")) for i, p in enumerate(params)]
        for call, snap in zip(calls, tracer.snapshot([p.grad for p in params]), strict=True):
            tracer.emit(call, "grad", [snap])
        self.pending[id(optimizer)] = (params, calls)

    def post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        entry = self.pending.pop(id(optimizer), None)
        if entry is None:
            return
        params, calls = entry
        keys = [sorted(k for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor))
                for p in params]
        tensors = [t for p, ks in zip(params, keys, strict=True) for t in (p, *(optimizer.state[p][k] for k in ks))]
        # fresh: optimizers may write parameters and states through `.data`, which bumps no version counter.
        snaps = iter(self.tracer.snapshot(tensors, fresh=True))
        for call, ks in zip(calls, keys, strict=True):
            call.extra = json.dumps({"state": ks}) if ks else None
            self.tracer.emit(call, "param", [next(snaps)])
            self.tracer.emit(call, "state", [next(snaps) for _ in ks])
        named = [pair for ref in self.models.get(optimizer, []) if (model := ref()) is not None
                 for pair in buffers(model)]
        if named:
            # fresh: a buffer written in place under no_grad through `.data` bumps no version counter.
            snaps = iter(self.tracer.snapshot([tensor for _, tensor in named], fresh=True))
            for name, _ in named:
                self.tracer.emit(self.tracer.begin("semantic", "optimizer", name), "buffer", [next(snaps)])


def install(tracer: Tracer) -> list[Undo]:
    """Register the global optimizer step hooks that record grads, parameters and states."""
    recorder = _StepRecorder(tracer)
    return [register_optimizer_step_pre_hook(Opaque(recorder.pre)).remove,
            register_optimizer_step_post_hook(Opaque(recorder.post)).remove]
