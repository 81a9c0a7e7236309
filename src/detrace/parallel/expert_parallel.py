"""`ExpertParallel` as a drop-in: torchtitan's expert-parallel style for a grouped-experts module, whose expert
weight gradients do not depend on the number of expert-parallel ranks.

    from detrace.parallel import ExpertParallel, parallelize_module   # instead of torchtitan's and torch's

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))     # ep inside: torchtitan's order
    for block in model.layers:
        parallelize_module(block.moe.experts, mesh["ep"], ExpertParallel())
    for step in range(steps):                             # torchtitan's gradient accumulation:
        for x, y in my_microbatches(step):                #   data rank d E + e: microbatches [(d E + e) n, ...)
            (loss_fn(model(x), y) / n).backward()         #   one backward each, the loss scaled by 1 / n
        optimizer.step()
        optimizer.zero_grad()

The experts module is torchtitan's `GroupedExperts`: parameters [E, ...] (expert first: w1, w2, w3), and
`forward(x, num_tokens_per_expert)` running expert e on its rows of x (sorted by expert). As torchtitan's style,
this one shards every parameter on dim 0 over the ep mesh (rank r keeps experts [r L, (r + 1) L), a DTensor with the
global name and shape), and its forward sends each routed row to the rank that holds its expert (all-to-all of the
counts, then of the rows) and the outputs back. What differs is the arithmetic, `FixedOrderExperts`'s: the rank
that holds an expert runs the module's own forward once per source rank, on that source's rows, with a view of the
weights of its own (`run_apart`), so each (source, microbatch) weight gradient is a leaf that autograd adds to
nothing; the leaves are summed in the fixed tree over the global microbatches (`ExpertGradientTree`), completed over
the experts' data-parallel replicas (the other dimension of the mesh the ep mesh was sliced from) and divided by
the data-parallel size dp x ep, as torchtitan's FSDP gradient divide factor averages the experts' gradients. With
n and E powers of two, every addition has the same two operands at every ep size, one process included.

A step is the backwards between two optimizer steps, as for `detrace.parallel.fully_shard`: each time the step's
count of microbatches reaches a power of two, the backward that completes it assigns each expert weight's gradient
(a DTensor like the weight: the tree's sum so far), so the last backward leaves the step's gradients in place for
whatever reads them before the optimizer (a gradient clipping, detrace's tracer); a global optimizer pre-hook closes
the step and refuses a number of microbatches that is not a power of two.

What it cannot keep, refused in one sentence: a mesh of more than one dimension (torchtitan's expert tensor
parallelism), an ep size that is not a power of two or that does not divide the experts, an ep mesh that does not
cover every rank or is sliced from a mesh whose other dimension is not data parallelism (dp) or lies inside ep, a
module with parameters of its submodules, experts given to fully_shard as well (torchtitan shards them over the dp
mesh: here their weights go to fully_shard's `ignored_params`), gradients left in the experts from before a step,
and a forward of the experts recomputed in a backward (activation checkpointing around them: each forward is a
microbatch's leaf).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.func import functional_call
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace._compat import current_graph_task_id, root_mesh
from detrace.errors import UsageError
from detrace.parallel.expert import FixedOrderExperts

__all__ = ["DATA_DIMS", "ExpertParallel"]

DATA_DIMS = ("dp", "data", "dp_shard", "dp_replicate", "fsdp", "edp", "efsdp", "dp_shard_mod_ep")
"""Names of a mesh dimension that may hold the experts' data-parallel replicas (torchtitan's and detrace's
layouts): another dimension beside ep (pp, tp, cp) holds other weights or the same microbatches."""


class _Experts:
    """One experts module's exchange and step: its FixedOrderExperts, and what closing a step needs."""

    def __init__(self, module: nn.Module, mesh: Any, replicas: dist.ProcessGroup | None, data: int) -> None:
        self.order = next(_CREATED)
        """The modules' order of parallelization, the same on every rank: their steps close in it, since a close may
        complete a tree over the replicas, a collective (a WeakSet's order follows addresses, which differ by rank)."""
        self.module = weakref.ref(module)
        self.mesh, self.data = mesh, data
        self.names = [name for name, _ in module.named_parameters(recurse=False)]
        self.exchange = FixedOrderExperts(self.local_weights, microbatches=None, group=mesh.get_group(),
                                          replicas=replicas, written=self.write)

    def params(self) -> list[nn.Parameter]:
        module = self.module()
        return [] if module is None else list(module.parameters(recurse=False))

    def local_weights(self) -> list[torch.Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p for p in self.params()]

    def write(self, sums: list[torch.Tensor]) -> None:
        """The gradients so far (each power-of-two count of a step's microbatches; the step's at its last): the
        tree's sums, averaged over the data ranks. In place before the optimizer step, as fully_shard's are, for
        what reads them first (a gradient clipping, detrace's tracer)."""
        for param, total in zip(self.params(), sums, strict=True):
            # the division by dp x ep (a power of two: exact) is torch's average over the data ranks
            param.grad = DTensor.from_local(total / self.data, self.mesh, [Shard(0)], run_check=False)

    def begin(self) -> None:
        """Open a step, at its first forward: refuse gradients left from the last (the step's replace them), and
        experts that fully_shard took over after this style."""
        module = self.module()
        if module is not None:
            _refuse_sharded(module)
        # zero_grad(set_to_none=False) leaves zeros, which the step's gradients may replace as torch would add to them
        if any(isinstance(p.grad, DTensor) and bool(p.grad.to_local().any()) for p in self.params()):
            raise UsageError("detrace.parallel.ExpertParallel: the experts hold gradients from before this step; "
                             "call optimizer.zero_grad() after each optimizer step")
        self.exchange.begin()


_STEPS: weakref.WeakSet[_Experts] = weakref.WeakSet()
_CREATED = itertools.count()
_HOOKED = False


def _close_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global optimizer pre-hook: the optimizer's experts close their step (refused unless every one took the same
    power-of-two number of microbatches), and the next forward opens a new one."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    steps = sorted((s for s in _STEPS if s.exchange.tree is not None and any(id(p) in owned for p in s.params())),
                   key=lambda s: s.order)
    counts = {s.exchange.end() for s in steps}
    if len(counts) > 1:
        raise UsageError(f"detrace.parallel.ExpertParallel: the experts modules took part in {sorted(counts)} "
                         "microbatches in one step; every MoE layer must take part in every microbatch")
    if any(count & (count - 1) for count in counts):
        raise UsageError(f"detrace.parallel.ExpertParallel: the experts took part in {max(counts)} microbatches in a "
                         "step; each rank must run a power-of-two number of microbatches per optimizer step")


def _refuse_sharded(module: nn.Module) -> None:
    """torchtitan gives the experts to fully_shard over the dp mesh too; here the style completes their gradients over
    the dp replicas itself, and fully_shard would reduce them again."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        raise UsageError("detrace.parallel.ExpertParallel's experts cannot be given to fully_shard as well: it sums "
                         "their gradients over the dp replicas itself; pass their weights to fully_shard's "
                         "ignored_params instead")


def _replicas(mesh: Any) -> tuple[dist.ProcessGroup | None, int]:
    """The experts' data-parallel replicas (the group of the root mesh's other dimension, or None) and the number
    of data ranks (dp x ep), from the mesh the ep mesh was sliced from; refuses what is not a dp x ep job."""
    root = root_mesh(mesh)
    if root.size() != dist.get_world_size():
        raise UsageError(f"ExpertParallel's mesh covers {root.size()} of the job's {dist.get_world_size()} ranks; "
                         "slice it from the mesh of the whole job (dp outside, ep inside)")
    if root.ndim == 1:
        return None, mesh.size()
    names: tuple[str, ...] = root.mesh_dim_names or ()
    if root.ndim != 2 or names[1] != mesh.mesh_dim_names[0] or names[0] not in DATA_DIMS:
        raise UsageError(f"ExpertParallel takes an ep mesh sliced from a (dp, ep) mesh, not from {names or root}: "
                         "the other dimension must be data parallelism, outside ep")
    return root.get_group(names[0]), root.size()


class ExpertParallel(ParallelStyle):
    """torchtitan's ExpertParallel (no arguments; for `parallelize_module(experts, ep_mesh, ExpertParallel())`),
    whose expert weight gradients are the fixed tree over the global microbatches at every ep size (see the module
    docstring for the loop's contract and what is refused)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        global _HOOKED
        _refuse_sharded(module)
        if device_mesh.ndim != 1:
            raise UsageError(f"ExpertParallel takes a 1-D expert-parallel mesh, not a {device_mesh.ndim}-D one "
                             "(expert tensor parallelism is not supported)")
        ep = device_mesh.size()
        if ep & (ep - 1):
            raise UsageError(f"ExpertParallel needs a power-of-two ep size, not {ep}")
        if any(True for child in module.children() for _ in child.parameters()):
            raise UsageError(f"ExpertParallel takes a grouped-experts module whose parameters are its own "
                             f"[experts, ...] tensors, not {type(module).__name__} with submodules' parameters")
        params = dict(module.named_parameters(recurse=False))
        if not params:
            raise UsageError(f"ExpertParallel takes a module with expert weights; {type(module).__name__} has none")
        experts = {p.shape[0] for p in params.values()}
        if len(experts) != 1 or next(iter(experts)) % ep:
            raise UsageError(f"ExpertParallel shards the experts (dim 0 of every parameter: {sorted(experts)}) "
                             f"over {ep} ranks, which must divide them evenly")
        replicas, data = _replicas(device_mesh)
        for name, param in params.items():
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        state = _Experts(module, device_mesh, replicas, data)
        plain_forward = module.forward  # the class's, bound: run on each source's rows with its views
        inside = [False]

        def run(rows: torch.Tensor, counts: list[int], *, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
            """The module's own forward once per source rank: its rows, its counts per local expert and its view
            of each weight (`weights`: [S, L, ...])."""
            local = len(counts) // ep
            outs, start = [], 0
            inside[0] = True
            try:
                for s in range(ep):
                    per_expert = counts[s * local:(s + 1) * local]
                    size = sum(per_expert)
                    views = {name: w[s] for name, w in zip(state.names, weights, strict=True)}
                    outs.append(functional_call(module, views, (rows[start:start + size],
                                                                torch.tensor(per_expert, device=rows.device))))
                    start += size
            finally:
                inside[0] = False
            return torch.cat(outs)

        def forward(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            if inside[0]:  # functional_call's call of the module, one source's rows
                return plain_forward(x, num_tokens_per_expert)
            if torch.is_grad_enabled() and current_graph_task_id() != -1:
                raise UsageError("detrace.parallel.ExpertParallel does not support recomputing the experts' forward "
                                 "in a backward (activation checkpointing around them): each forward is a "
                                 "microbatch's leaf of the tree")
            if state.exchange.tree is None and torch.is_grad_enabled():
                state.begin()  # the first forward of a step (the optimizer's pre-hook closed the last)
            return state.exchange(x, num_tokens_per_expert.to(torch.int64), run)

        # the instance's forward shadows the class's, for this module only (as detrace's tensor-parallel styles)
        object.__setattr__(module, "forward", forward)
        _STEPS.add(state)
        if not _HOOKED:
            register_optimizer_step_pre_hook(_close_steps)
            _HOOKED = True
        return module
