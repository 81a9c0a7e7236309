"""Pipeline parallelism of the reference model (`detrace.workload.sharding`'s pp layouts): a stage cut out of the
model (`_pipeline_stage`), and pp-invariant's bookkeeping on one stage (`_InvariantPipeline`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detrace.errors import UsageError
from detrace.parallel.expert import FixedOrderExperts
from detrace.parallel.tensor import global_parameter_names
from detrace.workload.expert_parallel import _expert_gradients, _fixed_order_experts, _is_expert, _refuse_recompute
from detrace.workload.layouts import Layout
from detrace.workload.model import HybridLM, ModelConfig, MoE, lm_losses, whole_tensor

PP_MICROBATCHES = 4
"""Microbatches of --parallel pp (pp-invariant takes --microbatches)."""
SCHEDULES = ("1f1b", "gpipe")
"""The pipeline schedules: torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe."""


def _pipeline_stage(model: HybridLM, stage: int, stages: int) -> HybridLM:
    """Cut `model` down to stage `stage` of `stages`: contiguous layers, the embedding on the first stage,
    the norm, head and MTP head on the last. Layer names (layers.<i>) stay those of the whole model."""
    n = len(model.layers)
    if n < stages:
        raise UsageError(f"{n} layers cannot fill {stages} pipeline stages")
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    for i in range(n):
        if not bounds[stage] <= i < bounds[stage + 1]:
            del model.layers[str(i)]
    if stage > 0:
        model.embedding = None
    if stage < stages - 1:
        model.norm = model.output = model.mtp = None
    return model


class _InvariantPipeline:
    """pp-invariant's bookkeeping on one stage: the tree over microbatch gradients and the seeded forwards
    (`detrace.parallel.pipeline`), and each microbatch's logged values, reduced to the bits that dp-invariant
    computes in one process (its tree over [lm, mtp, aux] / M per microbatch; its grad norm over the parameters in
    model order). Under pp x fsdp the stage's fsdp ranks are its data blocks, and the tree is in its reduce-scatter
    (`detrace.parallel.fsdp`). Under pp x ep its ep ranks are its data blocks and split its experts, whose gradients
    `detrace.parallel.expert.FixedOrderExperts` sums per source (pp x ep invariant) or autograd over every source's
    rows (the ordinary all-to-all, the control)."""

    def __init__(self, model: HybridLM, microbatches: int, layout: Layout) -> None:
        if layout.size("ep") > 1:
            _refuse_recompute(model.cfg)
        # the data blocks: over dp, fsdp or ep (a layout names one of them besides pp)
        self.blocks = layout.size("dp") * layout.size("fsdp") * layout.size("ep")
        self.block = (layout.coord("dp") * layout.size("fsdp") + layout.coord("fsdp")) * layout.size("ep") \
            + layout.coord("ep")
        if microbatches % self.blocks:
            raise UsageError(f"{microbatches} microbatches do not split evenly over {self.blocks} data-parallel ranks")
        self.M, self.device, self.layout = microbatches, layout.device, layout
        # this rank's block of the global microbatches, as in detrace.parallel.data
        self.n = microbatches // self.blocks
        self.first = self.block * self.n
        # the whole model's order, before the stage is cut out of it; under tp, tp-invariant's order by global name
        # (`by_global_name`), whose chunks one tp rank holds each
        self.tp = layout.size("tp") > 1
        self.names, self.chunked = global_parameter_names(model) if self.tp else \
            ([n for n, _ in model.named_parameters()], set())
        self.moe_names = [n for n, m in model.named_modules() if isinstance(m, MoE)]
        self.table = torch.zeros(0)
        self.forwards = 0
        self.exchanges: list[tuple[list[nn.Parameter], FixedOrderExperts]] = []

    def attach(self, stage: HybridLM, cfg: ModelConfig, *, tree: bool) -> None:
        """`tree`: sum the microbatches' gradients in the fixed tree here (and, under pp x ep, the experts' per
        source); else in the stage's fixed-order reduce-scatter (pp x fsdp), or (pp-plain, the control) in autograd's
        running sum, in the order the schedule runs the backwards."""
        from detrace.parallel.pipeline import SeededForwards, TreeGradients

        self.stage, self.cfg = stage, cfg
        self.grads = TreeGradients(stage.parameters(), self.n) if tree else None
        if tree and self.layout.size("ep") > 1:  # the experts' views are their own leaves: TreeGradients sees none
            self.exchanges = _fixed_order_experts(stage, microbatches=self.n, group=self.layout.group("ep"))
        self.seeds = SeededForwards(stage, self.device)
        here = dict(stage.named_modules())
        self.moes = [(2 + col, here[n]) for col, n in enumerate(self.moe_names) if n in here]
        stage.register_forward_hook(self._aux)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        from detrace.parallel.data import step_seed

        self.table = torch.zeros(self.M, 2 + len(self.moe_names), device=self.device)  # lm, mtp, aux per layer
        self.forwards, self.losses = self.first, self.first
        self.seeds.begin(step_seed(), first=self.first)
        if self.grads is not None:
            self.grads.begin()
        for _, exchange in self.exchanges:
            exchange.begin()
        yield
        if self.grads is not None:
            self.grads.finish()
        # complete the tree over the data blocks of dp, or of ep (whose ranks hold other experts: those are not
        # blocks of one sum, each holder has its experts' whole tree)
        data = next((dim for dim in ("dp", "ep") if self.layout.size(dim) > 1), None)
        if data is not None:
            from detrace.parallel.data import _buckets, _exchange, _flatten

            params = [p for n, p in self.stage.named_parameters()
                      if p.grad is not None and not (data == "ep" and _is_expert(n))]
            grads = [p.grad for p in params]
            buckets = _buckets([g for g in grads if g is not None])
            flats = _exchange(_flatten(buckets, grads), group=self.layout.group(data),
                              rank=self.layout.coord(data), world=self.layout.size(data), how="auto")
            for b, flat in zip(buckets, flats, strict=True):
                for i, part in zip(b.entries, flat.split(list(b.sizes)), strict=True):
                    params[i].grad = part.view_as(params[i])
        _expert_gradients(self.exchanges)

    def _aux(self, module: nn.Module, args: Any, output: Any) -> None:
        for col, moe in self.moes:
            self.table[self.forwards, col] = moe.pop_aux_loss().to(self.device)
        self.forwards += 1

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lm, mtp = lm_losses(logits, targets)
        self.table[self.losses, 0], self.table[self.losses, 1] = lm.detach(), mtp.detach()
        self.losses += 1
        return (lm + self.cfg.mtp_loss_coef * mtp) / self.M

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([lm, mtp, aux] summed over the microbatches in the tree, the squared gradient norm), from every
        stage's part: each value is held by one stage and gathered (x + 0 is x), then reduced as in one process."""
        from detrace.parallel.data import _tree_sum

        squares = torch.zeros(len(self.names), device=self.device)
        index = {n: i for i, n in enumerate(self.names)}
        # the dp and ep replicas hold the same gradient, the fsdp ranks (the ep ranks: of an expert) gather the same
        # whole one, and so do the tp ranks of a parameter that is not a chunk: the first of them counts it
        first = self.layout.coord("dp") == 0 and self.layout.coord("fsdp") == 0 and self.layout.coord("ep") == 0
        for name, p in self.stage.named_parameters():
            if p.grad is None:
                continue
            grad = whole_tensor(p.grad)  # fsdp: gathered (a collective over the stage's fsdp ranks), an exact copy
            if first and (name in self.chunked or self.layout.coord("tp") == 0):
                squares[index[name]] = grad.float().square().sum()
        if self.layout.coord("tp") > 0:  # the tp ranks of a stage log the same values: the first counts them
            self.table.zero_()
        mine = torch.cat([self.table.reshape(-1), squares])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        whole = every[0].clone()
        for other in every[1:]:
            whole += other
        table, squares = whole[:self.table.numel()].view_as(self.table), whole[self.table.numel():]
        logged = []
        for row in table:
            aux = sum(row[2:].unbind(), torch.zeros((), device=self.device))
            logged.append([torch.stack([row[0], row[1], aux]) / self.M])
        if self.tp:  # as tp-invariant sums them
            return _tree_sum(logged)[0], squares.sum()
        sq = torch.zeros((), device=self.device)
        for value in squares:
            sq += value
        return _tree_sum(logged)[0], sq
