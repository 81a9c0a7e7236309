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

GPipe and 1F1B run the forwards, and the backwards, of one stage in microbatch order 0..M-1; a schedule that runs
a stage's backwards in another order (torch's ScheduleLoopedBFS: M-1..0) names it (`order=`), and each gradient
takes its microbatch's leaf of the same tree (`TreeGradients` checks the count). What it gives up: autograd adds
each microbatch's gradient into `.grad` in place; here each is kept until its subtree completes (about log2 M
gradient buffers per parameter, in order or in reverse order).

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
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from detrace.errors import UsageError
from detrace.parallel.data import _microbatch_rng, _split, microbatch_seed

__all__ = ["SeededForwards", "TreeGradients"]


class _IndexedTree:
    """The fixed tree over leaves 0..M-1 (`detrace.parallel.data`'s: node [a, b) splits at `_split(a, b)`), its
    leaves pushed by index in any order: a node is summed (left + right) as soon as both halves are. Leaves in order
    (GPipe, 1F1B) or in reverse order (torch's ScheduleLoopedBFS's backwards) keep about log2 M partial sums; the sum
    is the same bits either way (the same two operands at each node, and floating-point addition is commutative)."""

    def __init__(self, leaves: int) -> None:
        self.leaves = leaves
        self.done: dict[tuple[int, int], torch.Tensor] = {}
        self.pushed: set[int] = set()

    def push(self, index: int, leaf: torch.Tensor) -> None:
        if not 0 <= index < self.leaves or index in self.pushed:
            raise UsageError(f"microbatch {index}'s gradient arrived twice or is not one of the step's {self.leaves}")
        self.pushed.add(index)
        path = [(0, self.leaves)]  # root to leaf
        while path[-1][1] - path[-1][0] > 1:
            a, b = path[-1]
            m = _split(a, b)
            path.append((a, m) if index < m else (m, b))
        node, value = path.pop(), leaf
        while path:
            parent = path.pop()
            left = node[0] == parent[0]
            sibling = (node[1], parent[1]) if left else (parent[0], node[0])
            other = self.done.pop(sibling, None)
            if other is None:
                break
            value = value.add_(other) if left else other.add_(value)  # left + right, into the left's buffer
            node = parent
        self.done[node] = value

    def result(self) -> torch.Tensor:
        assert len(self.pushed) == self.leaves, "the tree is not complete"
        return self.done[(0, self.leaves)]


class TreeGradients:
    """Each parameter's gradient summed over a step's M microbatches in the fixed tree (see the module doc)."""

    def __init__(self, params: Iterable[nn.Parameter], microbatches: int, *,
                 order: Sequence[int] | None = None) -> None:
        """`order`: the microbatch of each gradient as the backwards deliver them (a schedule's order; by default
        0..M-1), so that a schedule that runs a stage's backwards in another order sums the same tree."""
        if microbatches < 1:
            raise UsageError(f"microbatches must be positive, not {microbatches}")
        self.order = list(range(microbatches)) if order is None else list(order)
        if sorted(self.order) != list(range(microbatches)):
            raise UsageError(f"a step's backward order must be each of its {microbatches} microbatches once, not "
                             f"{self.order}")
        self.params = [p for p in params if p.requires_grad]
        self.microbatches = microbatches
        self._sums: dict[int, _IndexedTree] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._take)

    def begin(self) -> None:
        """Start a step: no gradient yet, an empty tree per parameter."""
        for p in self.params:
            p.grad = None
        self._sums = {id(p): _IndexedTree(self.microbatches) for p in self.params}

    def _take(self, param: torch.Tensor) -> None:
        tree = self._sums.get(id(param))
        if tree is None or param.grad is None:
            return
        if len(tree.pushed) == self.microbatches:
            raise UsageError("a parameter received more gradients than the step has microbatches")
        tree.push(self.order[len(tree.pushed)], param.grad)  # this microbatch's gradient alone: .grad was empty
        param.grad = None

    def take_assigned(self) -> None:
        """Take the gradients written into `.grad` without autograd's accumulation (so without the hook): a
        zero-bubble schedule's weight step computes them with `torch.autograd.grad` and assigns them."""
        for p in self.params:
            self._take(p)

    def finish(self) -> None:
        """End the step: every parameter's `.grad` is its tree sum (a parameter no microbatch used keeps None)."""
        for p in self.params:
            tree = self._sums[id(p)]
            if not tree.pushed:
                continue
            if len(tree.pushed) != self.microbatches:
                raise UsageError(f"a parameter received {len(tree.pushed)} gradients in a step of "
                                 f"{self.microbatches} microbatches")
            p.grad = tree.result()
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
