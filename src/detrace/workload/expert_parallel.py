"""Expert parallelism of the reference model (`detrace.workload.sharding`'s ep layouts): each MoE layer's experts
split over the "ep" mesh dimension, tokens exchanged with all_to_all_single (`AllToAllExchange`, the ordinary MoE)
or through `detrace.parallel.expert.FixedOrderExperts` (the invariant layouts, `_ExpertParallel`)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from detrace._compat import all_to_all_single_autograd
from detrace.errors import UsageError
from detrace.parallel.data import LossOf, invariant_backward
from detrace.parallel.expert import FixedOrderExperts
from detrace.parallel.fsdp import FixedOrderReduceScatter, check_complete, shard_invariantly
from detrace.workload.layouts import Layout
from detrace.workload.model import Experts, HybridLM, ModelConfig, local_tensor


class AllToAllExchange:
    """Send each routed token to the rank holding its expert, run the local experts, send the results back.

    Rank r of the ep group holds global experts [r * L, (r + 1) * L). Rows arrive grouped by (source rank,
    local expert); they are regrouped by local expert with split/cat (no accumulation), and the reverse
    permutation is applied before the return trip.
    """

    def __init__(self, group: dist.ProcessGroup, n_local: int) -> None:
        self.group, self.n_local = group, n_local
        self.ep = dist.get_world_size(group)

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        all_to_all = all_to_all_single_autograd()

        ep, L = self.ep, self.n_local
        recv_counts = torch.empty_like(counts)  # [ep * L]: rows from source s for my local expert e at s*L+e
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(ep, L).sum(1).tolist()
        recv_splits = recv_counts.view(ep, L).sum(1).tolist()
        received = all_to_all(routed, recv_splits, send_splits, self.group)  # [sum(recv_splits), D]
        sizes = recv_counts.tolist()
        chunks = received.split(sizes)
        by_expert = [s * L + e for e in range(L) for s in range(ep)]  # (source, expert) -> (expert, source)
        out = experts(torch.cat([chunks[i] for i in by_expert]), recv_counts.view(ep, L).sum(0).tolist())
        out_chunks = dict(zip(by_expert, out.split([sizes[i] for i in by_expert]), strict=True))
        back = torch.cat([out_chunks[i] for i in range(ep * L)])
        return all_to_all(back, send_splits, recv_splits, self.group)  # [R, D], in `routed`'s order


def _shard_experts(model: HybridLM, layout: Layout) -> None:
    """Keep only this ep rank's slice of every MoE layer's experts and route tokens through all_to_all.

    The slices are DTensors sharded on dim 0 over the "ep" mesh, not plain tensors: every rank's slice has
    the same name, and a checkpoint (DCP) of plain tensors would take them for replicas and keep one rank's
    for all; a Shard(0) DTensor says which rows of the whole [n_experts, ...] tensor each rank holds.
    """
    from torch.distributed.tensor import DTensor, Shard

    ep, r = layout.size("ep"), layout.coord("ep")
    if model.cfg.n_experts % ep:
        raise UsageError(f"{model.cfg.n_experts} experts do not split evenly over expert-parallel degree {ep}")
    n_local = model.cfg.n_experts // ep
    assert layout.mesh is not None
    mesh = layout.mesh["ep"]
    for moe in model.moe_layers():
        for name, w in list(moe.experts.named_parameters()):
            rows = w.detach()[r * n_local : (r + 1) * n_local].clone()
            setattr(moe.experts, name, nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False)))
        moe.exchange = AllToAllExchange(layout.group("ep"), n_local)


def _is_expert(name: str) -> bool:
    return ".experts." in f".{name}"


def _locals(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The local shards of `params` (what this rank computes with)."""
    return [local_tensor(p) for p in params]


def _refuse_recompute(cfg: ModelConfig) -> None:
    if cfg.recompute:
        # a recomputed forward would run the exchange again inside the backward, out of the tree's order
        raise UsageError("--recompute does not go with the ep layouts")


def _fixed_order_experts(model: HybridLM, *, microbatches: int, group: dist.ProcessGroup,
                         replicas: dist.ProcessGroup | None = None
                         ) -> list[tuple[list[nn.Parameter], FixedOrderExperts]]:
    """Every MoE layer of `model` (its experts split over `group`) exchanges through a `FixedOrderExperts` over
    `microbatches` per rank and step: (the layer's expert weights, its exchange), layer by layer."""
    exchanges = []
    for moe in model.moe_layers():
        params = [moe.experts.w1, moe.experts.w3, moe.experts.w2]
        exchange = FixedOrderExperts(functools.partial(_locals, params), microbatches=microbatches, group=group,
                                     replicas=replicas)
        moe.exchange = exchange
        exchanges.append((params, exchange))
    return exchanges


def _expert_gradients(exchanges: list[tuple[list[nn.Parameter], FixedOrderExperts]]) -> None:
    """End the step of every exchange: its experts' gradients are the tree's sums (DTensors where the weights are)."""
    from torch.distributed.tensor import DTensor

    for params, exchange in exchanges:
        for p, g in zip(params, exchange.finish(), strict=True):
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False) \
                if isinstance(p, DTensor) else g


class _ExpertParallel:
    """ep-invariant and ep-plain: every rank computes its block of the global microbatches (dp, fsdp and ep are data
    dimensions; tp ranks share their block); the non-expert parameters' gradients are summed in the fixed tree over
    the data ranks (`invariant_backward`), the experts' by `detrace.parallel.expert.FixedOrderExperts` (invariant),
    or by autograd over one GEMM per expert on every source's rows and the rank's microbatches in turn, then a sum
    over the dp replicas (plain: the ordinary all-to-all MoE, `AllToAllExchange`). Under tp (epExtpT) the attention
    and dense MLP projections are tp-invariant's chunks, each summed over the ep ranks; the experts' ep group is that
    of the rank's tp coordinate. ep-fsdp-invariant (fsdpFxepE): the experts' replicas are the fsdp ranks, and the
    other parameters are `fully_shard`ed over fsdp x ep (every rank: its data ranks, as torchtitan shards them over
    the data dimensions that ep borrows from) with fsdp-invariant's reduce-scatter, the same tree."""

    def __init__(self, model: HybridLM, microbatches: int, layout: Layout, *, invariant: bool) -> None:
        _refuse_recompute(model.cfg)
        self.microbatches, self.layout, self.invariant = microbatches, layout, invariant
        named = list(model.named_parameters())
        sharded = layout.size("ep") > 1
        data = layout.size("dp") * layout.size("fsdp") * layout.size("ep")
        # the data ranks: the world, or under tp the ep group (the tp ranks of a block compute alike)
        self.group = layout.group("ep") if layout.size("tp") > 1 else None
        # one process (ep1) is dp-invariant: every parameter in the tree of invariant_backward (the plain control
        # too: its experts are the ordinary accumulation only where they are split)
        self.experts = [p for n, p in named if _is_expert(n)] if sharded else []
        self.dense = [p for n, p in named if not (sharded and _is_expert(n))]
        self.plain_experts = sharded and not invariant
        other = "fsdp" if layout.size("fsdp") > 1 else "dp"
        self.replicas = layout.group(other) if sharded and layout.size(other) > 1 else None
        self.exchanges: list[tuple[list[nn.Parameter], FixedOrderExperts]] = []
        if sharded and invariant:
            self.exchanges = _fixed_order_experts(model, microbatches=microbatches // data, group=layout.group("ep"),
                                                  replicas=self.replicas)
        self.comms: list[FixedOrderReduceScatter] = []
        if layout.size("fsdp") > 1 and sharded:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            # the world in rank order is the data blocks' order (fsdp outer, ep inner): fsdp4's reduce-scatter
            world = dist.group.WORLD
            assert world is not None  # the layout's mesh started torch.distributed
            mesh = DeviceMesh.from_group(world, layout.device.type, mesh_dim_names=("data",))
            experts = set(self.experts)  # split over ep, replicas over fsdp: FixedOrderExperts sums them
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh, ignored_params=experts)
            fully_shard(model, mesh=mesh, ignored_params=experts)
            self.comms = shard_invariantly(model, microbatches=microbatches // data)

    def backward(self, loss_of: LossOf) -> torch.Tensor:
        """One step's gradients: the dense ones in the tree over the data ranks' blocks (in their reduce-scatter when
        sharded), the experts' as above. Returns the tree's sums of the logged values."""
        for p in self.experts:
            p.grad = None
        for _, exchange in self.exchanges:
            exchange.begin()
        _, sums = invariant_backward(self.dense, loss_of, microbatches=self.microbatches, group=self.group,
                                     sharded=bool(self.comms))
        check_complete(self.comms)
        _expert_gradients(self.exchanges)
        if self.plain_experts and self.replicas is not None:  # the ordinary sum over the replicas
            for p in self.experts:
                if p.grad is None:  # every replica contributes
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(local_tensor(p.grad), group=self.replicas)
        return sums
