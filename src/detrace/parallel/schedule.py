"""torch.distributed.pipelining's schedules as drop-ins (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
`ScheduleLoopedBFS`, `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`): each stage's gradients are the bits of
one process that runs the same microbatches through the whole model, whatever the number of stages and of stages
per rank.

    from detrace.parallel import PipelineStage, Schedule1F1B     # instead of torch.distributed.pipelining's

    stage = PipelineStage(stage_module, rank, stages, device)   # torch's own class, re-exported
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)
    # several stages per rank: ScheduleInterleaved1F1B([stage_a, stage_b], n_microbatches=M, loss_fn=loss_fn)
    for step in range(steps):
        schedule.step(x, target=y)                               # first stage x, last stage target=y
        optimizer.step()
        optimizer.zero_grad()

What differs with torch's schedules: nothing in a stage's forward or backward (a stage runs the whole model's ops on
its layers; the activation's gradient crosses the cut unchanged; a zero-bubble schedule's weight step computes the
same weight gradient as the full backward), and autograd adds each microbatch's gradient into `.grad` in the order
the schedule runs a stage's backwards: 0..M-1 in every schedule but ScheduleLoopedBFS, which runs them M-1..0. So
torch's schedules give the bits of a plain loop of M backwards (ScheduleLoopedBFS not even those); with detrace's
parallel APIs (whose `fully_shard` sums a step's microbatches in the fixed balanced tree at every number of shards,
one process included), a stage must sum its microbatches in the same tree, which these schedules do
(`TreeGradients`, told each stage's order from the schedule's actions). detrace's ScheduleLoopedBFS runs a stage's
backwards in microbatch order, in the same breadth-first shape, so that a rank's k-th loss (the tracer records a
loss at its backward) is microbatch k, as `detrace check-topology` reads it. And torch's `scale_grads=True` divides the
sum by M after the last backward, where the loop of torchtitan's contract divides each microbatch's loss by M before
its backward (`(loss / n).backward()`): the same bits only when M is a power of two, and a different loss at the
backward's root either way. Here `scale_grads=True` divides each loss by M before its backward, as that loop does;
the `losses` a step fills are still the loss function's own, unscaled.

What it cannot keep, refused in one sentence: gradients left in `.grad` from before the step (they would be added
outside the tree: call `optimizer.zero_grad()`), a stage with active dropout (its draws come from the stage's
process in the schedule's order, not from the one process's), and a zero-bubble schedule's split backward on a
stage that holds `fully_shard` modules (torch's weight step does not find their unsharded parameters).

A stage's modules given to `fully_shard` keep their own sum (detrace's `fully_shard` is the same tree), the stage's
module itself included (torch's stage turns its gradient sync and its resharding after backward off between
microbatches, which detrace's `fully_shard` accepts: it still reduces each microbatch into its tree).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import Schedule1F1B as TorchSchedule1F1B
from torch.distributed.pipelining import ScheduleGPipe as TorchScheduleGPipe
from torch.distributed.pipelining import ScheduleInterleaved1F1B as TorchScheduleInterleaved1F1B
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble as TorchScheduleInterleavedZeroBubble
from torch.distributed.pipelining import ScheduleLoopedBFS as TorchScheduleLoopedBFS
from torch.distributed.pipelining import ScheduleZBVZeroBubble as TorchScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from detrace._compat import backwards_in_microbatch_order, pipeline_backward_orders
from detrace.errors import UsageError
from detrace.parallel.pipeline import TreeGradients

__all__ = ["PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleLoopedBFS", "ScheduleZBVZeroBubble"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class _TreeSchedule:
    """torch's schedule (the next class in the MRO, whose constructor arguments it takes) whose stages sum their
    microbatches' gradients in the fixed tree."""

    _n_microbatches: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch_init = cast(Any, super()).__init__
        # Bound to torch's own signature (each schedule has its own), so that loss_fn and scale_grads are read
        # wherever the caller put them, by position or by name.
        bound = inspect.signature(torch_init).bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        self._unscaled: list[torch.Tensor] = []
        given["loss_fn"] = self._scaled(given["loss_fn"], given["n_microbatches"], given["scale_grads"])
        given["scale_grads"] = False  # `_scaled` divides each loss instead
        torch_init(*bound.args, **bound.kwargs)
        self._tree_init()

    def _tree_init(self) -> None:
        name = type(self).__name__
        stages = list(self._stages) if isinstance(self, PipelineScheduleMulti) else [cast(Any, self)._stage]
        # GPipe and 1F1B run a stage's backwards in microbatch order; the multi-stage schedules say theirs
        orders = (pipeline_backward_orders(self) if isinstance(self, PipelineScheduleMulti)
                  else {stages[0].stage_index: (list(range(self._n_microbatches)), False)})
        self._trees: list[TreeGradients] = []
        self._dropouts: list[nn.Module] = []
        for stage in stages:
            module: nn.Module = stage.submod
            # fully_shard's modules sum their own gradients (detrace's in the same tree); the tree here takes the rest
            sharded = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
            order, split = orders[stage.stage_index]
            if split and sharded:
                raise UsageError(f"detrace.parallel.{name} splits stage {stage.stage_index}'s backward into input "
                                 "and weight steps, which a stage holding fully_shard modules cannot run (torch's "
                                 "weight step does not find their unsharded parameters): use "
                                 "ScheduleInterleaved1F1B")
            tree = TreeGradients((p for p in module.parameters() if id(p) not in sharded), self._n_microbatches,
                                 order=order)
            if split:
                _split_backward(stage, tree)
            self._trees.append(tree)
            self._dropouts += [d for d in module.modules() if isinstance(d, _DROPOUTS) and d.p > 0]

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

    def step(self, *args: Any, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        """torch's `step`, each stage's gradients summed in the tree over the step's microbatches."""
        name = type(self).__name__
        if any(d.training for d in self._dropouts):
            raise UsageError(f"detrace.parallel.{name} does not support dropout in a stage (its draws depend on the "
                             "stage's process): set the dropout's p to 0 or call eval()")
        if any(p.grad is not None and bool(p.grad.any()) for tree in self._trees for p in tree.params):
            raise UsageError(f"detrace.parallel.{name}.step found gradients from before the step; call "
                             "optimizer.zero_grad() before each step (a step's microbatches are summed in a tree)")
        for tree in self._trees:
            tree.begin()
        self._unscaled = []
        result = cast(Any, super()).step(*args, losses=losses, **kwargs)
        for tree in self._trees:
            tree.finish()
        if losses is not None and self._unscaled:
            losses[:] = self._unscaled[-self._n_microbatches:]  # the loss function's values (the first step's
            # shape inference computes one more before them)
        return result


def _split_backward(stage: Any, tree: TreeGradients) -> None:
    """Make `tree` take the weight gradients of `stage`'s split backward (a zero-bubble schedule's weight step, which
    torch runs through `torch.autograd.grad` and assigns to `.grad`: no accumulation hook runs), after each
    microbatch's weight step. (Detrace's tracer sees such a backward, and its loss, by wrapping the stage class's two
    steps: record/rungs/metrics.py.)"""

    def weight_step_then_take(*args: Any, **kwargs: Any) -> None:
        type(stage).backward_weight_one_chunk(stage, *args, **kwargs)  # the class's, as wrapped when this runs
        tree.take_assigned()

    stage.backward_weight_one_chunk = weight_step_then_take


class ScheduleGPipe(_TreeSchedule, TorchScheduleGPipe):
    """torch.distributed.pipelining.ScheduleGPipe(stage, n_microbatches, loss_fn, ..., scale_grads=True), whose
    stage's gradients are the fixed tree over the microbatches (see the module's docstring)."""


class Schedule1F1B(_TreeSchedule, TorchSchedule1F1B):
    """torch.distributed.pipelining.Schedule1F1B(stage, n_microbatches, loss_fn, ..., scale_grads=True), whose
    stage's gradients are the fixed tree over the microbatches (see the module's docstring)."""


class ScheduleInterleaved1F1B(_TreeSchedule, TorchScheduleInterleaved1F1B):
    """torch.distributed.pipelining.ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn, ..., scale_grads=True),
    whose stages' gradients are each the fixed tree over the microbatches (see the module's docstring)."""


class ScheduleLoopedBFS(_TreeSchedule, TorchScheduleLoopedBFS):
    """torch.distributed.pipelining.ScheduleLoopedBFS(stages, n_microbatches, loss_fn, ..., scale_grads=True), whose
    stages' gradients are each the fixed tree over the microbatches, and whose stages run their backwards in
    microbatch order (torch's in reverse order), so that a rank's k-th loss is microbatch k, as `check-topology`
    reads it (see the module's docstring)."""

    def _tree_init(self) -> None:
        backwards_in_microbatch_order(self)
        super()._tree_init()


class ScheduleInterleavedZeroBubble(_TreeSchedule, TorchScheduleInterleavedZeroBubble):
    """torch.distributed.pipelining.ScheduleInterleavedZeroBubble(stages, n_microbatches, loss_fn, ...,
    scale_grads=True), whose stages' weight gradients are each the fixed tree over the microbatches (see the
    module's docstring)."""


class ScheduleZBVZeroBubble(_TreeSchedule, TorchScheduleZBVZeroBubble):
    """torch.distributed.pipelining.ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn, ..., scale_grads=True),
    whose two stages per rank have their weight gradients each summed in the fixed tree over the microbatches (see
    the module's docstring)."""
