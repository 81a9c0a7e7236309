"""Rung 0, metrics: exact bits of the step's scalars.

- loss: every scalar root of `backward()` given no gradient of its own (torch.autograd.backward is what
  Tensor.backward calls; a pipeline schedule passes `grad_tensors=[None]` for its loss), so a loop that calls
  `loss.backward()` is traced without edits. Several backward calls in a step (gradient
  accumulation) are told apart by their occurrence. A backward torch runs through `torch.autograd.grad` (a
  zero-bubble pipeline schedule's input and weight steps, torch's or detrace's) is taken alike: the tracer wraps the
  two steps of torch.distributed.pipelining's stages, the input step's root being the loss on the last stage.
- grad_norm: the 2-norm of this rank's gradients before any clipping: in a step that calls
  `torch.nn.utils.clip_grad_norm_` (Lightning does, through its precision plugins), the total norm it returns,
  computed before it scales the gradients; in one that calls `torch.nn.utils.clip_grads_with_norm_` (accelerate
  does, so the HF Trainer, after `get_total_norm`), the total norm it is given; else the norm as the optimizer
  step begins (local shards for DTensor parameters: never gathered, so no collective is added). The norm after
  clipping would hide a spike in the gradients: it is at most the clipping threshold.
- anything passed to `detrace.metric(name, value)`.

Values are read at the next flush, all of a batch in one host transfer. The backward wrapper also keeps the
phase ("backward") that module and op records carry.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace._compat import PIPELINE_STAGE_MODULE, pipeline_stage_base, without_data
from detrace.errors import UsageError
from detrace.record.opaque import Opaque
from detrace.record.patch import after_import, replace
from detrace.record.records import local_data
from detrace.record.session import Tracer


def record(tracer: Tracer, name: str, value: float | int | torch.Tensor) -> None:
    """Record one exact scalar in the current step (no-op outside the metrics window)."""
    if not (tracer.enabled and tracer.on["metrics"]):
        return
    if isinstance(value, torch.Tensor):
        if without_data(value):
            return  # a loss of a model run on meta or fake tensors (a FLOP count): no value to record
        if value.numel() != 1:
            raise UsageError(f"detrace.metric({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}")
        with tracer.own(), torch.no_grad():
            scalar: float | torch.Tensor = value.detach().clone()
        dtype = str(value.dtype).removeprefix("torch.")
    else:
        scalar, dtype = float(value), "float64"
    call = tracer.begin("metrics", tracer.phase, name)
    tracer.emit_metric(call, scalar, dtype)


def _roots(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def install(tracer: Tracer) -> list[Callable[[], None]]:
    original_backward = torch.autograd.backward

    @contextlib.contextmanager
    def backward_of(tensors: Any, grad_tensors: Any) -> Iterator[None]:
        tracer.training_begins()
        if tracer.on["metrics"]:
            roots = _roots(tensors)
            # a root without its own gradient is a loss (a pipeline schedule passes [None] for its loss)
            grads = [None] * len(roots) if grad_tensors is None else _roots(grad_tensors)
            for root, grad in zip(roots, grads, strict=False):
                if grad is None and isinstance(root, torch.Tensor) and root.numel() == 1:
                    record(tracer, "loss", root)
        phase, tracer.phase = tracer.phase, "backward"
        try:
            yield
        finally:
            tracer.phase = phase
            # DDP's reducer copied the reduced buckets into the gradients from C++ (no version bump).
            tracer.forget()
            if phase != "backward":
                tracer.scope.clear()  # module scopes a backward left open (see rungs/module.py)

    def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
        with backward_of(tensors, grad_tensors):
            return original_backward(tensors, grad_tensors, *args, **kwargs)

    stage_steps: list[Callable[[], None]] = []  # undoes the wrapping of the stages' backward steps

    def wrap_stages() -> None:
        # A zero-bubble schedule's input and weight steps (torch.autograd.grad, no torch.autograd.backward call): the
        # same backward, its root the loss the input step is given on the last stage (None on the others).
        if stage_steps or PIPELINE_STAGE_MODULE not in sys.modules:
            return
        stage = pipeline_stage_base()
        input_step, weight_step = stage.backward_one_chunk, stage.backward_weight_one_chunk
        given = inspect.signature(input_step)

        @functools.wraps(input_step)  # its signature is the step's (`given`, of a wrapper of it, binds the same)
        def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            bound = given.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["full_backward"]:  # through torch.autograd.backward, which the tracer sees
                return input_step(*args, **kwargs)
            loss = bound.arguments["loss"]
            with backward_of([] if loss is None else loss, None):
                return input_step(*args, **kwargs)

        @functools.wraps(weight_step)
        def backward_weight_one_chunk(*args: Any, **kwargs: Any) -> Any:
            with backward_of([], None):
                return weight_step(*args, **kwargs)

        stage_steps.extend((replace(stage, "backward_one_chunk", backward_one_chunk),
                            replace(stage, "backward_weight_one_chunk", backward_weight_one_chunk)))

    def unwrap_stages() -> None:
        while stage_steps:
            stage_steps.pop()()

    clipped: list[int] = []  # the step whose grad_norm clip_grad_norm_ recorded (the last one)
    original_clip = torch.nn.utils.clip_grad_norm_

    original_scale = torch.nn.utils.clip_grads_with_norm_

    def before_clipping(total: Any) -> None:
        # A plain scalar: a DTensor's total (tensor parallelism) is left to the optimizer hook's local norm.
        if tracer.on["metrics"] and type(total) is torch.Tensor and total.numel() == 1:
            record(tracer, "grad_norm", total)
            clipped[:] = [tracer.clock.step]

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        total = original_clip(*args, **kwargs)  # its scaling is torch's private function, not the one below
        before_clipping(total)
        return total

    def clip_grads_with_norm_(parameters: Any, max_norm: Any, total_norm: Any, *args: Any, **kwargs: Any) -> Any:
        before_clipping(total_norm)
        return original_scale(parameters, max_norm, total_norm, *args, **kwargs)

    def grad_norm(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not tracer.on["metrics"] or clipped == [tracer.clock.step] or tracer.clock.checkpoint_depth:
            return
        grads = [local_data(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            with tracer.own(), torch.no_grad():
                norm = torch.nn.utils.get_total_norm([g.detach() for g in grads])
            record(tracer, "grad_norm", norm)

    wrap_stages()
    watch = after_import([PIPELINE_STAGE_MODULE], wrap_stages)  # a program that imports torch's pipelining later
    return [replace(torch.autograd, "backward", Opaque(backward)), watch, unwrap_stages,
            replace(torch.nn.utils, "clip_grad_norm_", Opaque(clip_grad_norm_)),
            replace(torch.nn.utils, "clip_grads_with_norm_", Opaque(clip_grads_with_norm_)),
            register_optimizer_step_pre_hook(Opaque(grad_norm, noted=tracer.could_not)).remove]
