"""Pipeline parallelism whose bits do not depend on the number of stages or on the schedule.

A `torch.distributed.pipelining` schedule (GPipe, 1F1B) runs each microbatch's forward and backward on every stage
and accumulates each parameter's gradient over the microbatches in autograd (`.grad +=`, in the order the backwards
run), then optionally divides by their number. Here, on each stage:

- `TreeGradients` takes each microbatch's gradient of each parameter as autograd accumulates it (a post-accumulate
  hook, which leaves `.grad` empty again) and sums them in the fixed balanced binary tree over the microbatch
  indices of `detrace.parallel.data`: the bits of one process that runs the same M microbatches and sums them in
  that tree (DDP-invariant at any world size). The schedule must not scale the gradients (`scale_grads=False`):
  the loss is divided by M, a constant, as `invariant_backward`'s is.
- `SeededForwards` runs microbatch i's forward under generators seeded from the step's draw and i, as
  `invariant_backward` does, so router jitter or dropout in microbatch i do not depend on the stage that holds
  the layer or on when the schedule runs it.

Both schedules run the forwards, and the backwards, of one stage in microbatch order 0..M-1 (each leaf of the tree
arrives in order; `TreeGradients` checks the count). What it gives up: autograd adds each microbatch's gradient
into `.grad` in place; here each is kept until its subtree completes (about log2 M gradient buffers per parameter).

    from detrace.parallel import SeededForwards, TreeGradients
    from detrace.parallel.data import step_seed

    grads = TreeGradients(stage_module.parameters(), M)
    seeds = SeededForwards(stage_module, device=torch.device("cpu"))   # the stage's device
    for x, y in loader:                                  # each step:
        seeds.begin(step_seed())                         # one draw, the same on every rank and stage
        grads.begin()
        schedule.step(...)                               # ScheduleGPipe or Schedule1F1B, scale_grads=False
        grads.finish()                                   # each .grad: the tree over the M microbatches
        optimizer.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from detrace.errors import UsageError
from detrace.parallel.data import _Accumulator, _microbatch_rng, microbatch_seed

__all__ = ["SeededForwards", "TreeGradients"]


class TreeGradients:
    """Each parameter's gradient summed over a step's M microbatches in the fixed tree (see the module doc)."""

    def __init__(self, params: Iterable[nn.Parameter], microbatches: int) -> None:
        if microbatches < 1:
            raise UsageError(f"microbatches must be positive, not {microbatches}")
        self.params = [p for p in params if p.requires_grad]
        self.microbatches = microbatches
        self._sums: dict[int, _Accumulator] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._take)

    def begin(self) -> None:
        """Start a step: no gradient yet, an empty tree per parameter."""
        for p in self.params:
            p.grad = None
        self._sums = {id(p): _Accumulator(self.microbatches) for p in self.params}

    def _take(self, param: torch.Tensor) -> None:
        acc = self._sums.get(id(param))
        if acc is None or param.grad is None:
            return
        if acc.seen == self.microbatches:
            raise UsageError("a parameter received more gradients than the step has microbatches")
        acc.push([param.grad])  # this microbatch's gradient alone: .grad was empty before its backward
        param.grad = None

    def finish(self) -> None:
        """End the step: every parameter's `.grad` is its tree sum (a parameter no microbatch used keeps None)."""
        for p in self.params:
            acc = self._sums[id(p)]
            if acc.seen == 0:
                continue
            if acc.seen != self.microbatches:
                raise UsageError(f"a parameter received {acc.seen} gradients in a step of {self.microbatches} "
                                 "microbatches")
            p.grad = acc.result()[0]
        self._sums = {}


class SeededForwards:
    """Runs the k-th forward of `module` in a step under the generators of global microbatch k."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.device, self.base, self.count = device, 0, 0
        self._rng: contextlib.ExitStack | None = None
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def begin(self, base: int, *, first: int = 0) -> None:
        """Start a step whose draw from the global generator is `base` (`detrace.parallel.data.step_seed`) and
        whose first forward here is global microbatch `first` (a data-parallel rank's block starts there)."""
        self.base, self.count = base, first

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._rng = contextlib.ExitStack()
        self._rng.enter_context(_microbatch_rng(microbatch_seed(self.base, self.count), self.device))
        self.count += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._rng is not None:
            self._rng.close()
            self._rng = None
