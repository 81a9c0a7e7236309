"""Optimizer: grads as the step begins (role grad), then each parameter (role param) and each state tensor
(role state, extra {"state": [keys]} giving the order) after it, named by the parameter's qualified name; then
every buffer of the models the optimizer trains (role buffer, named by its qualified name). Buffers are model state
that no optimizer writes (BatchNorm statistics, counters, EMA copies, an MoE router's load statistics): recorded
with the parameters, a buffer that differs between two runs is a divergence like a parameter that does.

As the trace closes, the final state (phase "final", in the last step that holds records): each parameter that an
optimizer which stepped holds in its param_groups, of every model still alive that holds one, by qualified name
(role "param"), each once, then the model's digest (role "model": the fingerprint of those parameters' digests in
that order). It catches what changes the trained parameters after the last optimizer step (an unseeded draw, an
average, a quantisation). A parameter no optimizer here steps is not the state this rank trained: a pipeline rank
that keeps the whole model but steps only its stage's layers holds the other stages' layers at their initial values.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace.record.names import buffers, named_modules, owners, parameter_names
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
        self.stepped = False
        """Whether any optimizer stepped while the semantic rung recorded."""

    def pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tracer = self.tracer
        if not tracer.on["semantic"]:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.stepped = True
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


    def final(self) -> None:
        """Record the final state of the models the optimizers trained (see the module's docstring)."""
        tracer = self.tracer
        if not tracer.on.get("semantic"):
            # Not recording now (a step window that ended before the run did: locate's narrow runs): the state at
            # the end is not the state of the recorded steps, and two runs may part after the window.
            return
        models: dict[int, torch.nn.Module] = {}
        # the parameters (by id) in the param_groups of the optimizers that stepped (or, if none did, of those
        # alive): the state this rank trained
        trained: set[int] = set()
        for optimizer, refs in list(self.models.items()):
            trained |= {id(p) for group in optimizer.param_groups for p in group["params"]}
            for ref in refs:
                if (model := ref()) is not None:
                    models.setdefault(id(model), model)
        if not self.stepped:
            # No optimizer stepped (a resumed run that trained nothing): the models of the optimizers alive now, so
            # that the run still ends with its state recorded, in the step it began at. (Once one stepped, only
            # its models count: a model freed before the end, in a function that returned, is not recorded.)
            gc.collect()  # an optimizer that only a reference cycle keeps is no longer the program's
            for optimizer in [obj for obj in gc.get_objects() if issubclass(type(obj), torch.optim.Optimizer)]:
                params = {id(p) for group in optimizer.param_groups for p in group["params"]}
                trained |= params
                for model in owners(params):
                    models.setdefault(id(model), model)
        # named as the optimizer's steps named them: each once, though a stage module that holds some of the whole
        # model's layers is a model of its own too, which names them otherwise
        stepped = {key: name for names in list(self.names.values()) for key, name in names.items()}
        step = tracer.final_step
        for model in models.values():
            named = [(stepped.get(id(p), name), p) for name, p in _parameters(model) if id(p) in trained]
            trained -= {id(p) for _, p in named}
            if not named:
                continue
            snaps = tracer.snapshot([p for _, p in named], fresh=True, now=True)
            for (name, _), snap in zip(named, snaps, strict=True):
                call = tracer.begin("semantic", "final", name)
                call.step = step
                tracer.emit(call, "param", [snap])
            digests = [snap.digest for snap in snaps if snap is not None and snap.digest is not None]
            if len(digests) != len(named):
                continue  # a parameter without a digest (above --max-numel): no digest of the whole model
            # The digests as int64 bits (two's complement of each uint64): their fingerprint is the model's.
            whole = torch.tensor([d - (1 << 64) if d >= 1 << 63 else d for d in digests], dtype=torch.int64)
            call = tracer.begin("semantic", "final", type(model).__name__)
            call.step = step
            call.extra = json.dumps({"params": len(named)})
            tracer.emit(call, "model", tracer.snapshot([whole], fresh=True, now=True))


def _parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(qualified name, parameter) of a model, named as the bare model names it, each once, in the model's order."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, module in named_modules(model):
        for name, param in module.named_parameters(recurse=False):
            found.setdefault(id(param), (f"{prefix}.{name}" if prefix else name, param))
    return list(found.values())


def install(tracer: Tracer) -> list[Undo]:
    """Register the global optimizer step hooks that record grads, parameters and states, and the recording of the
    final state as the trace closes."""
    recorder = _StepRecorder(tracer)
    tracer.add_closing(recorder.final)
    return [register_optimizer_step_pre_hook(Opaque(recorder.pre, noted=tracer.could_not)).remove,
            register_optimizer_step_post_hook(Opaque(recorder.post, noted=tracer.could_not)).remove]
