"""Expert-parallel-invariant MoE (detrace.parallel.expert) with the ranks simulated in one process, and the ep layouts
by name. The real all-to-all runs in tests/e2e/test_topology.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from detrace.errors import UsageError
from detrace.ops import permute, route
from detrace.parallel.data import _tree_sum
from detrace.parallel.expert import ExpertGradientTree, FixedOrderExperts, run_apart
from detrace.parallel.layout import LAYOUT_ENV, Layout
from detrace.workload.model import Experts
from detrace.workload.train import resolve_layout

E, K, D, H, N, M = 8, 4, 32, 48, 48, 8
"""experts, fan-out, width, expert hidden width, tokens per microbatch, microbatches per step"""


def _microbatch(i: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Microbatch i's routed rows (sorted by expert), rows per expert, and the gradient that comes back to them."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(N, D, generator=g) * 10.0 ** torch.randint(-2, 3, (N, 1), generator=g)
    routing = route(torch.rand(N, E, generator=g).topk(K, dim=-1).indices, E)
    return permute(x, routing, backend="torch"), routing.counts.tolist(), torch.randn(N * K, D, generator=g)


def _experts() -> Experts:
    torch.manual_seed(0)
    return Experts(E, D, H, "none", grouped=True)


def _one_process() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """EP = 1: (each microbatch's expert outputs, its rows' gradients; the weight gradients' tree over the M)."""
    experts = _experts()
    outs, row_grads, leaves = [], [], []
    for i in range(M):
        rows, counts, back = _microbatch(i)
        rows.requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        out = experts(rows, counts)
        out.backward(back)
        outs.append(out.detach())
        row_grads.append(rows.grad)
        leaves.append([p.grad.clone() for p in (experts.w1, experts.w3, experts.w2)])  # type: ignore[union-attr]
    return outs, row_grads, _tree_sum(leaves)


def _rows_of(counts: list[int], owner: int, local: int) -> slice:
    return slice(sum(counts[:owner * local]), sum(counts[:(owner + 1) * local]))


def test_experts_run_apart_keep_the_bits_of_one_process_and_one_gemm_over_every_source_does_not() -> None:
    """W ranks simulated: rank s computes microbatches [s n, (s + 1) n) in step with the others; owner r holds
    experts [r L, (r + 1) L) and receives, at each step k, every source's rows for them (what the all-to-all
    delivers)."""
    outs, row_grads, tree = _one_process()
    experts = _experts()
    weights = [experts.w1.detach(), experts.w3.detach(), experts.w2.detach()]
    batches = [_microbatch(i) for i in range(M)]
    for world in (2, 4):
        n, local = M // world, E // world
        for owner in range(world):
            mine = [w[owner * local:(owner + 1) * local] for w in weights]
            grads = ExpertGradientTree(world, n)
            plain = [w.clone().requires_grad_(True) for w in mine]  # the ordinary layer: autograd accumulates
            for k in range(n):
                sources = [batches[s * n + k] for s in range(world)]
                cuts = [_rows_of(counts, owner, local) for _, counts, _ in sources]
                chunks = [rows[cut].clone().requires_grad_(True)
                          for (rows, _, _), cut in zip(sources, cuts, strict=True)]
                counts = [c[owner * local:(owner + 1) * local] for _, c, _ in sources]
                out, views = run_apart(experts, torch.cat(chunks), counts, mine)
                out.backward(torch.cat([back[cut] for (_, _, back), cut in zip(sources, cuts, strict=True)]))
                grads.push([v.grad for v in views])  # type: ignore[misc]
                got = out.detach().split([len(chunk) for chunk in chunks])
                for s, (out, chunk, cut) in enumerate(zip(got, chunks, cuts, strict=True)):
                    assert torch.equal(out, outs[s * n + k][cut]), (world, owner, k, s)
                    assert torch.equal(chunk.grad, row_grads[s * n + k][cut]), (world, owner, k, s)
                # the control: one GEMM per expert over every source's rows, as the ordinary all-to-all runs it
                by_expert = [torch.cat([chunk.detach()[sum(c[:e]):sum(c[:e + 1])] for chunk, c in
                                        zip(chunks, counts, strict=True)]) for e in range(local)]
                grad_by_expert = [torch.cat([back[cut][sum(c[:e]):sum(c[:e + 1])] for (_, _, back), cut, c in
                                             zip(sources, cuts, counts, strict=True)]) for e in range(local)]
                together = [sum(c[e] for c in counts) for e in range(local)]
                experts(torch.cat(by_expert), together, weights=tuple(plain)).backward(torch.cat(grad_by_expert))
            for got_sum, whole in zip(grads.result(), tree, strict=True):
                assert torch.equal(got_sum, whole[owner * local:(owner + 1) * local]), (world, owner)
            if owner == 0:
                assert not all(torch.equal(p.grad, whole[:local]) for p, whole in  # type: ignore[arg-type]
                               zip(plain, tree, strict=True)), world


def _one_f_one_b(microbatches: int, warmup: int) -> list[tuple[str, int]]:
    """A 1F1B stage's order: `warmup` forwards, then one forward and one backward in turn, then the last backwards."""
    order = [("f", i) for i in range(warmup)]
    for i in range(warmup, microbatches):
        order += [("f", i), ("b", i - warmup)]
    return order + [("b", i) for i in range(microbatches - warmup, microbatches)]


def test_fixed_order_experts_keep_the_bits_whatever_the_schedule_runs_the_backwards_in(
        free_port: Callable[[], int]) -> None:
    """A pipeline schedule runs several microbatches' forwards before their backwards (GPipe all of them, 1F1B
    some): each microbatch's leaves still go into the tree in microbatch (forward) order, the bits of one process
    (a one-rank group: the schedule, not the exchange, is in question here)."""
    outs, _, tree = _one_process()
    experts = _experts()
    weights = [experts.w1.detach(), experts.w3.detach(), experts.w2.detach()]
    batches = [_microbatch(i) for i in range(M)]
    orders = {
        "in order": [(kind, i) for i in range(M) for kind in ("f", "b")],  # invariant_backward's
        "gpipe": [("f", i) for i in range(M)] + [("b", i) for i in range(M)],
        "1f1b": _one_f_one_b(M, 2),  # stage 0 of 3
        "backwards reversed": [("f", i) for i in range(M)] + [("b", i) for i in reversed(range(M))],
    }
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for name, order in orders.items():
            exchange = FixedOrderExperts(lambda: weights, microbatches=M, group=dist.group.WORLD)
            exchange.begin()
            got: dict[int, torch.Tensor] = {}
            for kind, i in order:
                rows, counts, back = batches[i]
                if kind == "f":
                    got[i] = exchange(rows, torch.tensor(counts), experts)
                    assert torch.equal(got[i], outs[i]), (name, i)
                else:
                    got[i].backward(back)
            for sums, whole in zip(exchange.finish(), tree, strict=True):
                assert torch.equal(sums, whole), name
        # a microbatch whose backward gives the experts no gradient is a zero leaf in its place, the later ones after it
        exchange = FixedOrderExperts(lambda: weights, microbatches=M, group=dist.group.WORLD)
        exchange.begin()
        ran = [exchange(rows, torch.tensor(counts), experts) for rows, counts, _ in batches]
        for i, (out, (_, _, back)) in enumerate(zip(ran, batches, strict=True)):
            assert torch.equal(out, outs[i])
            if i != 2:
                out.backward(back)
        leaves = []
        for i in range(M):
            _, counts, back = batches[i]
            rows = batches[i][0]
            views = [w.clone().requires_grad_(True) for w in weights]
            experts(rows, counts, weights=tuple(views)).backward(back)
            leaves.append([torch.zeros_like(v) if i == 2 else v.grad for v in views])
        for sums, whole in zip(exchange.finish(), _tree_sum(leaves), strict=True):
            assert torch.equal(sums, whole)
    finally:
        dist.destroy_process_group()


def test_the_expert_gradient_tree_refuses_a_step_that_is_not_whole() -> None:
    with pytest.raises(UsageError, match="needs sources and microbatches"):
        ExpertGradientTree(2, 0)
    grads = ExpertGradientTree(2, 2)

    def leaves(sources: int) -> list[torch.Tensor]:
        return [torch.ones(sources, 3)]

    with pytest.raises(UsageError, match=r"gradients of \[1\] sources for a tree over 2"):
        grads.push(leaves(1))
    grads.push(leaves(2))
    with pytest.raises(UsageError, match="took part in 1 of the 2 microbatches"):
        grads.result()
    grads.push(leaves(2))
    with pytest.raises(UsageError, match="more than the 2 microbatches"):
        grads.push(leaves(2))
    assert torch.equal(grads.result()[0], torch.full((3,), 4.0))


def test_ep_layouts_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # expert parallelism is a data dimension: its ranks compute different microbatches (tp ranks share theirs)
    assert [Layout.parse("ep2xdp2").data_block(r) for r in range(4)] == [0, 1, 2, 3]
    assert [Layout.parse("ep2xtp2").data_block(r) for r in range(4)] == [0, 0, 1, 1]
    assert Layout.parse("ep4").data == 4
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_layout("invariant", "ep2xdp2", None) == ("ep-invariant", 1, 1, 2)
    assert resolve_layout("plain", "ep4", None) == ("ep-plain", 1, 1, 1)  # the experts' replicas: dp
    # composed with fsdp (the experts' replicas are the fsdp ranks, the rest sharded) and with tp: invariant only
    assert [Layout.parse("fsdp2xep2").data_block(r) for r in range(4)] == [0, 1, 2, 3]
    assert resolve_layout("invariant", "fsdp2xep2", None) == ("ep-fsdp-invariant", 1, 1, 2)
    assert resolve_layout("invariant", "ep2xtp2", None) == ("ep-invariant", 2, 1, 1)
    for name in ("fsdp2xep2", "ep2xtp2"):
        with pytest.raises(UsageError, match="not one the reference trainer runs with --parallel plain"):
            resolve_layout("plain", name, None)
    monkeypatch.setenv("WORLD_SIZE", "8")
    for name in ("fsdp2xep2xtp2", "dp2xep2xtp2", "dp2xfsdp2xep2"):  # meshes of 3 dimensions: not built
        with pytest.raises(UsageError, match="not one the reference trainer runs"):
            resolve_layout("invariant", name, None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_layout("invariant", "ep1", None) == ("ep-invariant", 1, 1, 1)


def test_the_trainer_refuses_what_the_ep_layouts_cannot_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from detrace.workload import layouts
    from detrace.workload.model import PRESETS, HybridLM, ModelConfig
    from detrace.workload.pipeline_parallel import _InvariantPipeline
    from detrace.workload.sharding import ParallelModel
    from detrace.workload.train import TrainConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = PRESETS["tiny"]["model"]
    assert isinstance(base, ModelConfig)
    with pytest.raises(UsageError, match="--recompute does not go with the ep layouts"):
        ParallelModel(replace(base, recompute=True, dispatch="fixed"), layouts.setup("ep-invariant"), seed=0,
                      batch_size=8, seq_len=32, microbatches=4)
    # nor with a pipeline's stages whose experts are split (pp x ep): refused before any group is used
    pp_ep = layouts.Layout(kind="ep-invariant", rank=0, world=4, device=torch.device("cpu"), sizes={"pp": 2, "ep": 2},
                           coords={"pp": 0, "ep": 0})
    with pytest.raises(UsageError, match="--recompute does not go with the ep layouts"):
        _InvariantPipeline(HybridLM(replace(base, recompute=True, dispatch="fixed")), 4, pp_ep)
    # nor NVFP4 (its per-tensor scale is over one call of the experts; an ep rank calls its own only): refused before
    # any group is used; mxfp8's block scales are not refused
    ep2 = layouts.Layout(kind="ep-invariant", rank=0, world=2, device=torch.device("cpu"), sizes={"ep": 2},
                         coords={"ep": 0})
    with pytest.raises(UsageError, match="--quant nvfp4 does not keep one process's bits under expert parallelism"):
        ParallelModel(replace(base, quant="nvfp4", dispatch="fixed"), ep2, seed=0, batch_size=8, seq_len=32,
                      microbatches=4)
    with pytest.raises(AssertionError):  # past the refusal: ep2 without a mesh cannot be sharded
        ParallelModel(replace(base, quant="mxfp8", dispatch="fixed"), ep2, seed=0, batch_size=8, seq_len=32,
                      microbatches=4)
    with pytest.raises(UsageError, match="replicas of a sharded model go with"):
        TrainConfig(parallel="dp-invariant", microbatches=4, dispatch="fixed", replicas=2)
    # tensor parallelism composes with ep-invariant's experts, not with the fsdp x ep mesh (its sharded parameters
    # would be tp chunks of fsdp shards) nor with the plain control
    assert TrainConfig(parallel="ep-invariant", microbatches=4, dispatch="fixed", tp=2).tp == 2
    for kind in ("ep-fsdp-invariant", "ep-plain"):
        with pytest.raises(UsageError, match="--tp goes with"):
            TrainConfig(parallel=kind, microbatches=4, dispatch="fixed", tp=2)
        monkeypatch.setenv("WORLD_SIZE", "4")  # refused before torch.distributed starts
        with pytest.raises(UsageError, match=f"--parallel {kind} has no tensor-parallel dimension"):
            layouts.setup(kind, tp=2)
        monkeypatch.delenv("WORLD_SIZE")
