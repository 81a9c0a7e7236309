"""Expert parallelism (and data parallelism around it: a dp x ep mesh) with the same bits on every mesh.

    torchrun --standalone --nproc-per-node 2 examples/topology/expert.py             # DETRACE_LAYOUT=ep2
    detrace check-topology --layouts ep1,ep2,ep4 -- python examples/topology/expert.py
    detrace check-topology --layouts ep1,ep2,dp2xep2 -- python examples/topology/expert.py
    detrace check-topology --layouts ep1,ep2 -- python examples/topology/expert.py --plain   # the control: differs

An MoE layer's experts are split over the E ranks of the ep dimension (rank r holds experts [r L, (r + 1) L)); as in
torchtitan the ep ranks also split the data, so every rank computes its own block of the global batch and sends
each routed token to the rank that holds its expert with an all-to-all (dispatch), and back (combine).
`FixedOrderExperts` is that exchange with the bits of one process; `--plain` swaps in the ordinary one (each local
expert one GEMM over every source rank's tokens, autograd adding up its weight gradient), which changes with E.

The contract (docs/topology.md): the process group even at one process (torchrun), the mesh from DETRACE_LAYOUT
(which check-topology sets for each named layout), the same whole weights built on every rank before each keeps its
experts (a DTensor sharded on dim 0: the same parameter names and global shapes on every mesh), the same global
batch of M microbatches on every rank, each microbatch's loss scaled by a global constant.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import detrace
from detrace.ops import combine, grouped_mm, permute, route
from detrace.parallel import FixedOrderExperts, Layout, invariant_backward

M, B, STEPS = 4, 8, 3  # M microbatches of B samples per global batch: M divisible by every data size checked
DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2  # EXPERTS divisible by every ep size checked


def run_experts(rows: torch.Tensor, counts: list[int], weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """rows sorted by expert (counts[g] rows for group g) -> each expert's GELU MLP, one GEMM per group.
    weights: (w1 [L, HIDDEN, DIM], w2 [L, DIM, HIDDEN]), or FixedOrderExperts' [S, L, ...] views, one set of
    experts per source rank, whose groups are (source, local expert)."""
    w1, w2 = weights
    return grouped_mm(nn.functional.gelu(grouped_mm(rows, w1, counts)), w2, counts)


class PlainAllToAll:
    """The ordinary expert-parallel exchange, the control: each local expert runs once on every source rank's rows,
    so its weight gradient is one GEMM over all of them, which E changes."""

    def __init__(self, group: dist.ProcessGroup, weights: list[DTensor]) -> None:
        self.group, self.weights, self.ep = group, weights, dist.get_world_size(group)

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n_local = self.ep, len(counts) // self.ep
        recv_counts = torch.empty_like(counts)  # [s L + e]: rows of source s for my local expert e
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send, recv = counts.view(ep, -1).sum(1).tolist(), recv_counts.view(ep, -1).sum(1).tolist()
        received = dist_fn.all_to_all_single(routed.new_empty(sum(recv), DIM), routed, recv, send, group=self.group)
        sizes = recv_counts.tolist()
        chunks = received.split(sizes)
        by_expert = [s * n_local + e for e in range(n_local) for s in range(ep)]  # (source, expert) -> (expert, ..)
        out = run_experts(torch.cat([chunks[i] for i in by_expert]), recv_counts.view(ep, -1).sum(0).tolist(),
                          tuple(w.to_local() for w in self.weights))
        back = dict(zip(by_expert, out.split([sizes[i] for i in by_expert]), strict=True))
        ordered = torch.cat([back[i] for i in range(len(sizes))])  # (source, expert) order again
        return dist_fn.all_to_all_single(routed.new_empty(routed.shape), ordered, send, recv, group=self.group)


class MoE(nn.Module):
    """A router picks TOP_K of EXPERTS experts per token; the experts are split over the ep ranks."""

    def __init__(self, ep_mesh: DeviceMesh, *, plain: bool, microbatches: int,
                 replicas: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        whole = [torch.randn(EXPERTS, HIDDEN, DIM) * DIM ** -0.5, torch.randn(EXPERTS, DIM, HIDDEN) * HIDDEN ** -0.5]
        n_local, r = EXPERTS // ep_mesh.size(), ep_mesh.get_local_rank()
        self.w1, self.w2 = (nn.Parameter(DTensor.from_local(w[r * n_local:(r + 1) * n_local].clone(), ep_mesh,
                                                            [Shard(0)], run_check=False)) for w in whole)
        group = ep_mesh.get_group()
        self.plain = PlainAllToAll(group, [self.w1, self.w2]) if plain else None
        self.exchange = FixedOrderExperts(lambda: [self.w1.to_local(), self.w2.to_local()],
                                          microbatches=microbatches, group=group, replicas=replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = nn.functional.softmax(self.router(x), dim=-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        routing = route(chosen, EXPERTS)  # expert-sorted rows, tokens in order within an expert
        routed = permute(x, routing)
        out = self.plain(routed, routing.counts) if self.plain else self.exchange(routed, routing.counts, run_experts)
        return combine(out, routing, weights / weights.sum(-1, keepdim=True))  # each token's TOP_K rows, in order

    def expert_gradients(self) -> None:
        """After the step's backwards (FixedOrderExperts only): the experts' gradients, its tree's sums."""
        for w, grad in zip((self.w1, self.w2), self.exchange.finish(), strict=True):
            w.grad = DTensor.from_local(grad, w.device_mesh, w.placements, run_check=False)


class Model(nn.Module):
    def __init__(self, ep_mesh: DeviceMesh, **moe: object) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 4)
        self.moe = MoE(ep_mesh, **moe)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(x))
        return self.head(h + self.moe(h))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true", help="the ordinary all-to-all exchange (the control)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # nccl on GPUs
    world = dist.get_world_size()
    layout = Layout.parse(os.environ.get("DETRACE_LAYOUT", f"ep{world}"))
    dp, ep = layout.size("dp"), layout.size("ep")
    if dp * ep != world or layout.dims - {"dp", "ep"}:
        raise SystemExit(f"layout {layout} is not a dp x ep mesh of {world} ranks")
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))  # ep inner: a data block's neighbours
    detrace.deterministic(0)  # every rank builds the same whole weights
    model = Model(mesh["ep"], plain=args.plain, microbatches=M // world,
                  replicas=mesh.get_group("dp") if dp > 1 else None)
    experts = {model.moe.w1, model.moe.w2}
    dense = [p for p in model.parameters() if p not in experts]  # summed over every rank by invariant_backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)  # the global batch, the same on every rank
        x, y = torch.randn(M, B, DIM, generator=data), torch.randint(0, 4, (M, B), generator=data)

        def loss_of(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:  # global microbatch i
            return nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") / (M * B)  # a global constant

        if not args.plain:
            model.moe.exchange.begin()  # this step's expert gradients: one leaf per microbatch and source rank
        invariant_backward(dense, loss_of, microbatches=M)  # rank r: microbatches [r M / W, (r + 1) M / W)
        if args.plain:  # autograd added each expert's gradient over this rank's microbatches; now over the replicas
            if dp > 1:
                for w in experts:
                    dist.all_reduce(w.grad.to_local(), group=mesh.get_group("dp"))
        else:
            model.moe.expert_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
