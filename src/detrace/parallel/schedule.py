"""`ScheduleGPipe` and `Schedule1F1B` as drop-ins: torch.distributed.pipelining's schedules, whose gradients are
the bits of one process that runs the same microbatches, whatever the number of stages.

    from detrace.parallel import PipelineStage, Schedule1F1B     # instead of torch.distributed.pipelining's

    stage = PipelineStage(stage_module, rank, stages, device)   # torch's own class, re-exported
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
    for step in range(steps):
        schedule.step(x, target=y)                               # first stage x, last stage target=y
        optimizer.step()
        optimizer.zero_grad()

What differs with torch's schedules: nothing in a stage's forward or backward (a stage runs the whole model's ops on
its layers; the activation's gradient crosses the cut unchanged), and the backwards of one stage run in microbatch
order 0..M-1 in both schedules, so each `.grad` is added in the order of a plain loop of M backwards. So torch's
schedules give the bits of that loop with torch's own per-module accumulation; with detrace's parallel APIs (whose
`fully_shard` sums a step's microbatches in the fixed balanced tree at every number of shards, one process
included), a stage must sum its microbatches in the same tree, which these schedules do (`TreeGradients`). And
torch's `scale_grads=True` divides the sum by M after the last backward, where the loop of torchtitan's contract
divides each microbatch's loss by M before its backward (`(loss / n).backward()`): the same bits only when M is a
power of two, and a different loss at the backward's root either way. Here `scale_grads=True` divides each loss by M
before its backward, as that loop does; the `losses` a step fills are still the loss function's own, unscaled.

What it cannot keep, refused in one sentence: gradients left in `.grad` from before the step (they would be added
outside the tree: call `optimizer.zero_grad()`), and a stage with active dropout (its draws come from the stage's
process in the schedule's order, not from the one process's).

A stage's modules given to `fully_shard` keep their own sum (detrace's `fully_shard` is the same tree); the stage's
module itself must not be one (torch's stage turns its gradient sync off between microbatches, which detrace's
`fully_shard` refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import Schedule1F1B as TorchSchedule1F1B
from torch.distributed.pipelining import ScheduleGPipe as TorchScheduleGPipe

from detrace.errors import UsageError
from detrace.parallel.pipeline import TreeGradients

__all__ = ["PipelineStage", "Schedule1F1B", "ScheduleGPipe"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class _TreeSchedule:
    """The step of a single-stage schedule whose stage sums its microbatches' gradients in the fixed tree."""

    _stage: Any
    _n_microbatches: int

    def _tree_init(self, name: str) -> None:
        self._unscaled: list[torch.Tensor] = []
        module: nn.Module = self._stage.submod
        # fully_shard's modules sum their own gradients (detrace's in the same tree); the tree here takes the rest
        sharded = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
        self._params = [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]
        self._dropouts = [d for d in module.modules() if isinstance(d, _DROPOUTS) and d.p > 0]
        self._grads = TreeGradients(self._params, self._n_microbatches)
        self._name = name

    def _scaled(self, loss_fn: Callable[..., Any] | None, microbatches: int, scale_grads: bool
                ) -> Callable[..., Any] | None:
        """`loss_fn` divided by M (torch's scale_grads=True), each value kept for the step's `losses`."""
        if loss_fn is None or not scale_grads:
            return loss_fn

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            self._unscaled.append(loss)
            return loss / microbatches  # the loop's `(loss / n).backward()`, not the sum's division after it
        return scaled

    def _tree_step(self, run: Callable[[], Any], losses: list[Any] | None) -> Any:
        if any(d.training for d in self._dropouts):
            raise UsageError(f"detrace.parallel.{self._name} does not support dropout in a stage (its draws depend "
                             "on the stage's process): set the dropout's p to 0 or call eval()")
        if any(p.grad is not None and bool(p.grad.any()) for p in self._params):
            raise UsageError(f"detrace.parallel.{self._name}.step found gradients from before the step; call "
                             "optimizer.zero_grad() before each step (a step's microbatches are summed in a tree)")
        self._grads.begin()
        self._unscaled = []
        result = run()
        self._grads.finish()
        if losses is not None and self._unscaled:
            losses[:] = self._unscaled[-self._n_microbatches:]  # the loss function's values (the first step's
            # shape inference computes one more before them)
        return result


class ScheduleGPipe(TorchScheduleGPipe, _TreeSchedule):
    """torch.distributed.pipelining.ScheduleGPipe(stage, n_microbatches, loss_fn, ..., scale_grads=True), whose
    stage's gradients are the fixed tree over the microbatches (see the module's docstring)."""

    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Callable[..., Any] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        super().__init__(stage, n_microbatches, self._scaled(loss_fn, n_microbatches, scale_grads), args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads=False)
        self._tree_init("ScheduleGPipe")

    def step(self, *args: Any, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        return self._tree_step(lambda: super(ScheduleGPipe, self).step(*args, losses=losses, **kwargs), losses)


class Schedule1F1B(TorchSchedule1F1B, _TreeSchedule):
    """torch.distributed.pipelining.Schedule1F1B(stage, n_microbatches, loss_fn, ..., scale_grads=True), whose
    stage's gradients are the fixed tree over the microbatches (see the module's docstring)."""

    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Callable[..., Any] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        super().__init__(stage, n_microbatches, self._scaled(loss_fn, n_microbatches, scale_grads), args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads=False)
        self._tree_init("Schedule1F1B")

    def step(self, *args: Any, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        return self._tree_step(lambda: super(Schedule1F1B, self).step(*args, losses=losses, **kwargs), losses)
