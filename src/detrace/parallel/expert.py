"""Expert parallelism whose bits do not depend on the number of expert-parallel ranks.

The experts of each MoE layer are split over the E ep ranks: rank r holds experts [r L, (r + 1) L). As in
torchtitan, the ep ranks also split the data of every other layer: each rank computes its block of the global
batch's M microbatches (the contiguous blocks of `detrace.parallel.data`), all ranks in step. For each microbatch
the routed tokens go to the ranks that hold their experts with one all-to-all (dispatch) and come back with another
(combine): `torch.distributed`'s all_to_all_single, differentiable (its backward is the reverse all-to-all); gloo
has it on CPU, NCCL on GPU.

An ordinary expert-parallel layer runs each local expert as one GEMM over the tokens of every source rank, and
autograd adds up the expert weight gradients over sources and microbatches: the rows one GEMM reduces over, and the
order of the additions, change with E. `FixedOrderExperts` keeps the bits of one process (E = 1):

- the rank that holds an expert runs it on each source rank's rows apart: the same GEMMs on the same rows as one
  process running that microbatch (`detrace.ops.grouped_mm`: one GEMM per expert and microbatch), all sources in
  one call over the (source, local expert) groups;
- each source computes with its own view of the expert weights (one `expand` of each over the sources: no copy),
  so the weight gradient of each (source, microbatch) is a slice of its own, never added into another one by
  autograd;
- the leaves are summed in the fixed balanced tree over the global microbatch indices of `detrace.parallel.data`: a
  source's block is a node of the tree (`ExpertGradientTree`), the holder adds its ep group's blocks in the tree's
  order, and where the experts have replicas over another data dimension (dp) the replicas complete the tree with
  data parallelism's exchange.

The token side (router, `detrace.ops` permute and combine, aux loss) runs on the source rank as in one process.

A leaf is pushed into the tree once its microbatch's backward has run, and those of every earlier microbatch of the
step: in forward order, which is the microbatch order under `invariant_backward` (each microbatch's forward and
backward in turn) and under a pipeline schedule (GPipe runs every forward before the backwards, 1F1B interleaves
them; both run the forwards in microbatch order). The ep ranks of a pipeline stage run the same schedule, so their
all-to-alls meet.

What it gives up against the ordinary all-to-all: E smaller GEMMs per local expert instead of one (less efficient
on a GPU for few tokens); the weight gradients are added after each microbatch's backward (about log2(M / W) + 1
partial sums per source kept until the step's last microbatch; under a pipeline schedule also the leaves of the
microbatches whose forward has run and whose backward, or an earlier one's, has not) instead of inside the GEMM;
and the ranks run their microbatches in step, one all-to-all pair per microbatch and MoE layer.

    exchange = FixedOrderExperts(lambda: [w1, w3, w2], microbatches=M // W, group=ep_group)
    exchange.begin()                                        # each step, before the microbatches
    invariant_backward(dense_parameters, loss_of, microbatches=M)   # the model calls exchange(rows, counts, experts)
    grads = exchange.finish()                               # the tree's sums, in the order of the weights
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from detrace._compat import all_to_all_single_autograd, wait_collective
from detrace.errors import UsageError
from detrace.parallel.data import _Accumulator, _exchange, _tree_sum

__all__ = ["ExpertGradientTree", "FixedOrderExperts", "run_apart"]

Experts = Callable[..., torch.Tensor]
"""The local experts: (rows [R, D] sorted by local expert, rows per local expert, weights=views) -> [R, D]
(`detrace.workload.model.Experts`)."""


def run_apart(experts: Experts, rows: torch.Tensor, counts: Sequence[list[int]],
              weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the local experts on each source's rows apart, each source with its own view of `weights`.

    rows [R, D]: source by source, each source's sorted by local expert (counts[s][e] rows of source s for local
    expert e). Returns (the outputs [R, D] in `rows`' order; the views, one [S, L, ...] `expand` of each weight,
    whose `.grad` after the backward holds source s's weight gradient at [s])."""
    views = [w.detach().expand(len(counts), *w.shape).requires_grad_(True) for w in weights]
    return experts(rows, [c for per_expert in counts for c in per_expert], weights=tuple(views)), views


class ExpertGradientTree:
    """The fixed tree over one step's expert weight gradients: one leaf per (source, microbatch), where source s
    computes the block of microbatches [s n, (s + 1) n) of its group. `push` takes one microbatch's leaves of every
    source, stacked: one [S, ...] tensor per weight, source s's leaf at [s]; `result` is the sum over the S n
    microbatches in the tree of `detrace.parallel.data`.

    `microbatches` None: n is learnt at `result`, and must be a power of two (the drop-in `ExpertParallel`, whose
    loop says nothing of n before its optimizer step): the leaves stream into a binary counter, whose merges are
    that tree's nodes when n is a power of two."""

    def __init__(self, sources: int, microbatches: int | None) -> None:
        if sources < 1 or (microbatches is not None and microbatches < 1):
            raise UsageError(f"an expert gradient tree needs sources and microbatches, not {sources} and "
                             f"{microbatches}")
        self.sources, self.microbatches = sources, microbatches
        # every source's block has the same tree: one stacked partial sum per level serves them all (an addition
        # is elementwise, so stacking changes no bit)
        self.tree = _Accumulator(microbatches) if microbatches is not None else None
        self.counter: list[tuple[int, list[torch.Tensor]]] = []
        """With n unknown: (leaves, stacked partial sums) of each open node, oldest first."""
        self.pushed = 0

    @property
    def seen(self) -> int:
        """Microbatches pushed so far this step."""
        return self.pushed

    def push(self, leaves: Sequence[torch.Tensor]) -> None:
        if any(leaf.shape[0] != self.sources for leaf in leaves):
            raise UsageError(f"gradients of {[leaf.shape[0] for leaf in leaves]} sources for a tree over "
                             f"{self.sources} sources")
        if self.seen == self.microbatches:
            raise UsageError(f"the experts took part in more than the {self.microbatches} microbatches of a step")
        self.pushed += 1
        if self.tree is not None:
            self.tree.push(list(leaves))
            return
        self.counter.append((1, list(leaves)))  # the leaves are the views' own gradients: added into in place
        while len(self.counter) > 1 and self.counter[-1][0] == self.counter[-2][0]:
            size, right = self.counter.pop()
            for left_buf, right_buf in zip(self.counter[-1][1], right, strict=True):
                left_buf.add_(right_buf)  # left + right: the same two operands at every ep size
            self.counter[-1] = (2 * size, self.counter[-1][1])

    def result(self) -> list[torch.Tensor]:
        if self.tree is None:
            if self.seen & (self.seen - 1) or not self.seen:
                raise UsageError(f"the experts took part in {self.seen} microbatches in a step; each rank must run "
                                 "a power-of-two number of microbatches per optimizer step")
            # copies: the tree's additions go into their left operands, and the counter goes on after a result
            blocks = [b.clone() for b in self.counter[0][1]]
        elif self.seen != self.microbatches:
            raise UsageError(f"the experts took part in {self.seen} of the {self.microbatches} microbatches of a "
                             "step: every MoE layer must take part in every microbatch's forward and backward")
        else:
            blocks = self.tree.result()
        # the blocks are the tree's nodes: their sums, added in the tree's order over the sources, are its top (a
        # copy of the root: it would otherwise keep the S blocks' buffer alive as the gradient)
        return [root.clone() for root in _tree_sum([[b[s] for b in blocks] for s in range(self.sources)])]


class FixedOrderExperts:
    """One MoE layer's expert-parallel exchange (the model's `MoE.exchange`): sends each routed row to the rank
    that holds its expert, runs the local experts on each source's rows apart, sends the results back; and sums the
    expert weight gradients in the fixed tree (see the module docstring).

    Args:
        weights: returns the local expert weights (plain tensors; each [L, ...]) to compute with.
        microbatches: n, the microbatches each rank computes per step (M / W); None: any power of two, counted
            until `finish` (`ExpertGradientTree`).
        group: the expert-parallel group (None: one process, no exchange; the experts run as they are).
        replicas: the group over which the experts are replicated (the dp ranks that hold the same experts), or
            None; its ranks complete the tree over their blocks.
        written: with `microbatches` None, called with the sums so far (completed over `replicas`: a collective)
            each time the step's count of microbatches reaches a power of two, during the backward that completes
            it: the gradients are in place once the last backward has run, as fully_shard's are (`end` closes the
            step); None: the sums come from `finish`.
    """

    def __init__(self, weights: Callable[[], Sequence[torch.Tensor]], *, microbatches: int | None,
                 group: dist.ProcessGroup, replicas: dist.ProcessGroup | None = None,
                 written: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        if microbatches is not None and microbatches < 1:
            raise UsageError(f"microbatches per rank must be positive, not {microbatches}")
        self.weights, self.microbatches, self.group, self.replicas = weights, microbatches, group, replicas
        self.written = written
        self.ep = dist.get_world_size(group)
        self.tree: ExpertGradientTree | None = None
        # The views of this step's microbatches not pushed yet, in forward order (the microbatch order), each with
        # the count of its views whose gradient has not arrived. A schedule may run several forwards before their
        # backwards (a pipeline's GPipe runs them all first, 1F1B interleaves them): a microbatch's leaves go into
        # the tree once its backward and those of every earlier one have run, in forward order whatever the
        # schedule.
        self._held: list[tuple[list[torch.Tensor], list[int]]] = []

    def begin(self) -> None:
        """Start a step: the next `microbatches` forwards and backwards are its leaves."""
        self.tree, self._held = ExpertGradientTree(self.ep, self.microbatches), []

    def _hold(self, views: list[torch.Tensor]) -> None:
        """Keep one microbatch's views (one [S, ...] expand of each weight) until its backward has set their
        gradients."""
        waiting = [len(views)]

        def arrived(view: torch.Tensor) -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                self._flush(whole=False)

        for view in views:
            view.register_post_accumulate_grad_hook(arrived)
        self._held.append((views, waiting))

    def _flush(self, *, whole: bool) -> None:
        """Push the held microbatches whose backward has run, in forward order, up to the first one still waiting
        (`whole`: every held one; a view whose backward gave it no gradient is a zero leaf)."""
        while self._held and self.tree is not None and (whole or self._held[0][1][0] == 0):
            views, _ = self._held.pop(0)
            self.tree.push([torch.zeros_like(v) if v.grad is None else v.grad for v in views])
            seen = self.tree.seen
            if self.written is not None and not seen & (seen - 1):  # a power of two: the counter is one node
                self.written(self._complete(self.tree.result()))

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """routed [R, D] sorted by global expert, counts [E L] rows per global expert -> the experts' outputs [R, D],
        in `routed`'s order."""
        all_to_all = all_to_all_single_autograd()
        ep = self.ep
        recv_counts = torch.empty_like(counts)  # row s: the rows source s sends for each of my local experts
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(ep, -1).sum(1).tolist()
        per_source = recv_counts.view(ep, -1)
        recv = per_source.sum(1).tolist()
        received = all_to_all(routed, recv, send, self.group)  # source by source, each sorted by local expert
        # The functional all-to-all returns a lazily waited tensor subclass that its views keep: every op of the
        # experts on a view would go through its Python dispatch (1.5-2x the step on CPU). Wait once, no copy.
        out, views = run_apart(experts, wait_collective(received), per_source.tolist(), self.weights())
        if self.tree is not None and torch.is_grad_enabled():
            self._hold(views)
        return all_to_all(out, send, recv, self.group)

    def finish(self) -> list[torch.Tensor]:
        """End the step: the expert weight gradients summed over the global batch's microbatches, in the order and
        shapes of `weights()`. Collective over `replicas`."""
        if self.tree is None:
            raise UsageError("FixedOrderExperts.finish() without begin(): no step is open")
        self._flush(whole=True)
        tree, self.tree = self.tree, None
        return self._complete(tree.result())

    def end(self) -> int:
        """End a step whose sums went to `written`: push what is held (a forward whose backward gave the experts
        nothing is a zero leaf) and return the number of microbatches the step took (0 with no step open)."""
        if self.tree is None:
            return 0
        self._flush(whole=True)
        tree, self.tree = self.tree, None
        return tree.seen

    def _complete(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tree's sums completed over the replicas, in the tree's order above their blocks."""
        if self.replicas is None or dist.get_world_size(self.replicas) == 1:
            return sums
        flats = _exchange([s.reshape(-1) for s in sums], group=self.replicas, rank=dist.get_rank(self.replicas),
                          world=dist.get_world_size(self.replicas), how="auto", donate=True)
        return [flat.view_as(s) for flat, s in zip(flats, sums, strict=True)]
