"""The input batch, at the semantic rung: the tensors entering the outermost module's forward, per call.

Data enters the model from outside the traced ops (a loader, an augmentation, the labels): when two runs first
differ there, nothing traced computed the difference, and the diff must say "the input batch differs" rather than
blame an op. So every forward call of an outermost module (one called while no module runs on this thread) that
has parameters (a model, not a loss function) records its positional and keyword tensors, in call order, as one
call named "batch" in phase "data", with extra {"module": class name, "args": [argument of each tensor]}. Each
microbatch of a step is one such call (told apart by its occurrence). When detrace's data handling knows the
dataset indices of the batch's samples (`_events.sample_source`: the framework integrations' sampler), a call named
"samples" follows it in phase "data", the indices as one int64 tensor and in extra {"samples": [...]}:
`detrace ablate` names the samples of a spike's batch from them.

`nn.Module.__call__` is replaced for the life of the tracer: a global forward pre-hook would see no keyword
arguments (HF models take the whole batch as keywords) and would move every module call to torch's slow path.
Only forward-phase calls are recorded: a checkpointed block recomputed in backward is no batch. Compiled code
(Dynamo tracing a module call) goes straight to the original, and Dynamo never compiles the wrapper's own frame: a
frame of ours around a compiled module's call would move where Dynamo's graphs begin and break, and with them
Inductor's fusions and the bits (a model with graph breaks ended with other parameters on an AVX-512 CPU).

The same outermost forward call tells the step clock, at every rung, that the next step's work begins: the
trailing work of the step before (what ran after its optimizer step) is over (see detrace.record.steps). Unless it
is an evaluation (`evaluates`): then it is no step's work. It begins the phase "evaluation" of the step it follows
(what runs between step K and K+1 belongs to step K), which lasts until the training's work begins again, and its
tensors are recorded as a "batch" call in that phase. A run that evaluates where another does not (a continuous run
evaluates at the step where a resumed one starts) thus keeps its steps and its training's records in line, and the
diff compares the evaluations apart (detrace.analyze.apart).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from detrace import _events
from detrace._compat import without_data
from detrace.record.opaque import Opaque, skip_frames
from detrace.record.patch import replace
from detrace.record.records import Call, recorded_leaves, shares_data
from detrace.record.rungs import loader_samples
from detrace.record.session import Tracer


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _trained(module: nn.Module) -> bool:
    """Whether `module` has a parameter that requires grad (a frozen one has none: an EMA copy, a teacher)."""
    return any(parameter.requires_grad for parameter in module.parameters())


class _Teacher:
    """A frozen model's call with grad disabled after an optimizer step, which `frozen_evaluates` takes for an
    evaluation (its records held by the tracer, `Tracer.hold`): it was the next step's work after all when the
    training forward that follows takes one of its input tensors, as a distillation teacher's does
    (`teacher(x)`, then `student(x)`); an EMA copy's evaluation takes a validation batch."""

    def __init__(self, module: nn.Module, tensors: list[Any]) -> None:
        self.modules = [module]
        self.tensors = list(tensors)
        """Kept alive until the training forward (one step's gap), so that an identity is never another's."""

    def shares(self, tensors: list[Any]) -> bool:
        """Whether `tensors` include one of the held call's inputs, or a view of the same storage."""
        return shares_data(tensors, self.tensors)


def evaluates(module: nn.Module) -> bool:
    """Whether an outermost call of `module` is an evaluation: the trained model (a parameter that requires grad)
    in eval mode with grad disabled (`torch.no_grad`, `torch.inference_mode`), as HF Trainer's `evaluate`,
    Lightning's validation loop and a loop's own `model.eval()` + `torch.no_grad()` run it. Each condition alone is
    not enough: a frozen model (a VAE encoder, a distillation teacher) runs under `no_grad` in eval mode as part of
    every training step, a policy generates under `no_grad` in train mode (RL), and a model with frozen BatchNorm
    trains in eval mode. (A forward with grad disabled on a batch of another DataLoader than the training's is an
    evaluation in any mode, `loader_samples.from_another_loader`: a validation loop that forgot `model.eval()`.)"""
    if torch.is_grad_enabled() or module.training:
        return False
    return _trained(module)


def frozen_evaluates(module: nn.Module) -> bool:
    """Whether a call of a frozen `module` (no parameter requires grad: an EMA copy, a teacher) with grad disabled,
    made in a step's trailing work (after its optimizer step), is an evaluation. It is unless the model's forward
    was a step's work before (the caller's `stepping` tells): a teacher runs in the first step's work, before any
    optimizer step, and again, in the same place, at the start of each later step's; an EMA copy evaluated after the
    checkpoint steps never does, and counting its forward as the next step's work would make one step more at the
    end of the run and take its batch for a training one. A teacher first called after an optimizer step (switched
    on at step N) is taken for an evaluation until the training forward that follows shows otherwise (`_Teacher`):
    a run resumed after N, whose process calls it before any step, counts it as the step's work from the start."""
    if torch.is_grad_enabled():
        return False
    return not _trained(module)


def record(tracer: Tracer, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           samples: list[int] | None = None) -> Call | None:
    """Record the tensors of one outermost forward call, in phase "data" (or "evaluation" during one: its outputs
    are recorded too, by `evaluated`), and the dataset indices of its `samples` when known. Returns the
    evaluation's call."""
    names: list[str] = []
    tensors: list[Any] = []
    for name, value in [*((str(i), v) for i, v in enumerate(args)), *kwargs.items()]:
        leaves = recorded_leaves(value)
        names += [name] * len(leaves)
        tensors += leaves
    evaluation = tracer.phase == "evaluation"
    if not tensors and not evaluation:
        return None
    extra = json.dumps({"module": type(module).__name__, "args": names})
    call = tracer.begin("semantic", "evaluation" if evaluation else "data", "batch", extra=extra)
    tracer.emit(call, "input", tracer.snapshot(tensors))
    if samples is not None and not evaluation:
        taken = tracer.begin("semantic", "data", "samples", extra=json.dumps({"samples": samples}))
        tracer.emit(taken, "input", tracer.snapshot([torch.tensor(samples, dtype=torch.int64)]))
    return call if evaluation else None


def evaluated(tracer: Tracer, call: Call, output: Any) -> None:
    """The outputs of an evaluation's forward call: at the semantic rung they are what an evaluation computed
    (nothing else of it is recorded there), so a nondeterministic evaluation is found without the op rung."""
    tracer.emit(call, "output", tracer.snapshot(recorded_leaves(output)))


def install(tracer: Tracer) -> list[Callable[[], None]]:
    original = nn.Module.__call__
    local = threading.local()
    stepping: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    """The models whose outermost forward was a step's work: a frozen one among them is a teacher (`evaluates`)."""
    held: list[_Teacher] = []
    """The frozen model's call whose records the tracer holds (`_Teacher`), while it may be a teacher's."""

    def begins(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
        """An outermost module call in the forward: a model's begins the step's work (or an evaluation), and its
        tensors are recorded. During an evaluation, any model called with grad disabled (a frozen decoder it uses)
        is part of it."""
        if tracer.busy or not _has_parameters(module) or without_data(next(module.parameters())):
            # (a model on the meta device, whose forward counts FLOPs, as litgpt's does before its first step: no
            # batch, no step's work, and no call numbered in the step it runs in, which differs on resume)
            return None
        samples = None
        teacher = held.pop() if held and tracer.holding else None
        held.clear()
        frozen = tracer.clock.trailing and module not in stepping and frozen_evaluates(module)
        tensors = recorded_leaves((args, kwargs)) if teacher is not None or frozen else []
        if (evaluates(module) or frozen or (not torch.is_grad_enabled() and (
                tracer.phase == "evaluation" or loader_samples.from_another_loader()))):
            if teacher is not None:
                if teacher.shares(tensors):  # another model on the same batch (a second teacher)
                    teacher.modules.append(module)
                    held.append(teacher)
                else:  # another batch: an evaluation's loop
                    tracer.let_go()
            elif frozen and tracer.phase != "evaluation":
                tracer.hold()
                held.append(_Teacher(module, tensors))
            tracer.evaluation_begins()
            loader_samples.evaluation_takes()
        else:
            was_work = False
            if teacher is not None and teacher.shares(tensors):
                was_work = True
                stepping.update(teacher.modules)
            stepping.add(module)
            tracer.training_begins(held_was_work=was_work)
            if _trained(module) or torch.is_grad_enabled():  # a teacher's call takes no batch: the student's does
                loader_samples.training_takes(recorded_leaves((args, kwargs)))
                samples = _events.next_samples()  # taken at every training forward: the next one, the next batch
        return record(tracer, module, args, kwargs, samples) if tracer.on["semantic"] else None

    outermost = Opaque(begins)
    finished = Opaque(evaluated)

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # is_compiling() first: Dynamo inlines this function into compiled regions, and must not trace the rest.
        if torch.compiler.is_compiling() or getattr(local, "inside", False) or not tracer.enabled:
            return original(module, *args, **kwargs)
        local.inside = True
        try:
            evaluation = outermost(module, args, kwargs) if tracer.phase in ("forward", "evaluation") else None
            output = original(module, *args, **kwargs)
            if evaluation is not None:
                finished(tracer, evaluation, output)
            return output
        finally:
            local.inside = False

    # Dynamo runs the wrapper's frames as they are and compiles the module call inside, where its graphs would begin
    # without detrace (the same code object for every tracer: once per process is enough); the recording runs with
    # Dynamo off (a model called from a compiled function that Dynamo runs eagerly).
    skip_frames(call)
    return [replace(nn.Module, "__call__", call)]
