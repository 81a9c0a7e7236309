"""Layouts by name (detrace.parallel.layout), the reference trainer's choice of layout, and FSDP-invariant's
fixed-order reduce-scatter (detrace.parallel.fsdp) with the ranks simulated in one process."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from detrace.errors import UsageError
from detrace.parallel.data import _tree_sum
from detrace.parallel.fsdp import FixedOrderReduceScatter, check_complete
from detrace.parallel.layout import LAYOUT_ENV, Layout
from detrace.workload.train import resolve_layout


def test_layout_names() -> None:
    layout = Layout.parse("tp2xfsdp2")  # any order in the name; the mesh is outermost first
    assert layout.sizes == (("fsdp", 2), ("tp", 2)) and layout.world == 4 and str(layout) == "tp2xfsdp2"
    assert Layout.parse("2x2").sizes == (("dp", 2), ("tp", 2))  # the older D x T form
    assert Layout.parse("pp2xdp2").size("pp") == 2 and Layout.parse("ep2").size("tp") == 1
    assert Layout.parse("pp3").world == 3  # stages need not be a power of two
    assert Layout.parse("fsdp1").dims == frozenset() and Layout.parse("fsdp4xtp1").dims == {"fsdp"}
    # the data block of each rank: its coordinate over dp and fsdp, tensor parallelism innermost, pp outermost
    assert [Layout.parse("fsdp2xtp2").data_block(r) for r in range(4)] == [0, 0, 1, 1]
    assert [Layout.parse("pp2xdp2").data_block(r) for r in range(4)] == [0, 1, 0, 1]
    assert [Layout.parse("dp2xfsdp2").data_block(r) for r in range(4)] == [0, 1, 2, 3]
    # HSDP is dpDxfsdpF (the reference trainer's name, and torch's 2-D mesh (replicate, shard) outermost first)
    assert Layout.parse("fsdp2xdp4").sizes == (("dp", 4), ("fsdp", 2)) and Layout.parse("fsdp2xdp4").data == 8
    with pytest.raises(UsageError, match="named dimensions joined by x"):
        Layout.parse("hsdp2x2")
    for bad in ("", "fsdp", "fsdp2xfsdp2", "zz2", "tp3", "dp0", "2x", "fsdp2x", "2x2x2", "FSDP2"):
        with pytest.raises(UsageError):
            Layout.parse(bad)
    with pytest.raises(UsageError, match="in the order"):
        Layout(name="x", sizes=(("tp", 2), ("dp", 2)))
    with pytest.raises(UsageError, match="is not one of"):
        Layout.parse("tp2").data_block(2)


def test_the_trainer_runs_a_named_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_layout("invariant", "fsdp4", None) == ("fsdp-invariant", 1, 1, 1)
    assert resolve_layout("plain", "fsdp4", None) == ("fsdp-plain", 1, 1, 1)
    assert resolve_layout("invariant", "2x2", None) == ("tp-invariant", 2, 1, 1)
    assert resolve_layout("plain", "dp2xtp2", None) == ("tp-plain", 2, 1, 1)
    assert resolve_layout("invariant", None, None) == ("dp-invariant", 1, 1, 1)  # dp over every process
    assert resolve_layout("invariant", "pp4", None) == ("pp-invariant", 1, 4, 1)
    assert resolve_layout("invariant", "pp2xdp2", None) == ("pp-invariant", 1, 2, 1)
    assert resolve_layout("invariant", "fsdp2xtp2", None) == ("fsdp-invariant", 2, 1, 1)
    assert resolve_layout("invariant", "dp2xfsdp2", None) == ("fsdp-invariant", 1, 1, 2)  # 2 replicas of 2 shards
    assert resolve_layout("plain", "dp2xfsdp2", None) == ("fsdp-plain", 1, 1, 2)  # fully_shard's HSDP
    assert resolve_layout("invariant", "pp2xtp2", None) == ("pp-invariant", 2, 2, 1)
    assert resolve_layout("plain", "pp2xdp2", None) == ("pp-plain", 1, 2, 1)  # the control: autograd's running sum
    # 2 stages, each sharded over 2 ranks (the tree in each stage's reduce-scatter), in either order of the name
    assert resolve_layout("invariant", "pp2xfsdp2", None) == ("fsdp-invariant", 1, 2, 1)
    assert resolve_layout("invariant", "fsdp2xpp2", None) == ("fsdp-invariant", 1, 2, 1)
    assert resolve_layout("plain", "pp2xfsdp2", None) == ("fsdp-plain", 1, 2, 1)  # torch's stage and fully_shard's
    # 2 stages, each one's experts split over 2 ranks that split its data too; the control: torch's stage, all-to-all
    assert resolve_layout("invariant", "pp2xep2", None) == ("ep-invariant", 1, 2, 1)
    assert resolve_layout("invariant", "ep2xpp2", None) == ("ep-invariant", 1, 2, 1)
    assert resolve_layout("plain", "pp2xep2", None) == ("ep-plain", 1, 2, 1)
    monkeypatch.setenv(LAYOUT_ENV, "fsdp4")  # what check-topology --layouts sets
    assert resolve_layout("invariant", None, None) == ("fsdp-invariant", 1, 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_layout("invariant", "fsdp1", None) == ("fsdp-invariant", 1, 1, 1)
    # one stage is no pipeline: named beside other dimensions, pp1 changes nothing
    assert resolve_layout("invariant", "pp1xep1", None) == resolve_layout("invariant", "ep1", None)
    assert resolve_layout("invariant", "pp1", None) == ("dp-invariant", 1, 1, 1)  # sizes 1: one process, unsplit
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("ep2", "tp2", "fsdp2", "dp2"):
        assert resolve_layout("invariant", f"pp1x{name}", None) == resolve_layout("invariant", name, None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_layout("invariant", "1x1", None) == ("tp-invariant", 1, 1, 1)  # a named tp: the chunked layers
    for world, args, match in [(1, ("invariant", "fsdp2", None), "takes 2 processes, not 1"),
                               (4, ("plain", "ep2xtp2", None), "not one the reference trainer runs"),
                               (4, ("plain", "pp2xtp2", None), "invariant only, ppPxtpT, fsdpFxtpT"),
                               (8, ("invariant", "pp2xep2xtp2", None), "not one the reference trainer runs"),
                               (4, ("plain", "fsdp2xtp2", None), "runs with --parallel plain"),
                               (8, ("invariant", "pp2xdp2xfsdp2", None), "runs with --parallel invariant"),
                               (8, ("invariant", "dp2xfsdp2xtp2", None), "runs with --parallel invariant"),
                               (1, ("plain", "dp1", None), "not one the reference trainer runs"),
                               (1, ("invariant", "fsdp1", 2), "not from --tp"),
                               (1, ("ddp", "fsdp1", None), "--layout goes with")]:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises(UsageError, match=match):
            resolve_layout(*args)


def test_pipeline_stages_go_with_the_fsdp_and_ep_layouts_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from detrace.workload import layouts
    from detrace.workload.train import TrainConfig

    common: dict[str, Any] = {"microbatches": 4, "dispatch": "fixed", "stages": 2}
    for kind in ("fsdp-invariant", "fsdp-plain", "ep-invariant", "ep-plain"):  # ppPxfsdpF, ppPxepE, their controls
        assert TrainConfig(parallel=kind, **common).stages == 2
    for other in ({"parallel": "fsdp-invariant", "replicas": 2}, {"parallel": "ep-invariant", "replicas": 2},
                  {"parallel": "fsdp-invariant", "tp": 2}, {"parallel": "ep-invariant", "tp": 2},
                  {"parallel": "ep-fsdp-invariant"}, {"parallel": "dp-invariant"}):
        with pytest.raises(UsageError, match="pipeline stages other than 1"):
            TrainConfig(**common, **other)
    monkeypatch.setenv("WORLD_SIZE", "6")  # 3 shards (or ep ranks) a stage: the tree splits its blocks in halves
    for kind in ("fsdp-invariant", "ep-invariant"):
        with pytest.raises(UsageError, match="power of two dividing the world size 6"):
            layouts.setup(kind, pp=2)

def _grads(microbatches: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # magnitudes spread over orders of magnitude: a sum's bits depend on its order
    return [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
            for _ in range(microbatches)]


def _simulated_fsdp(grads: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter output for its shard, with W ranks simulated: rank r computes the microbatches
    [r n, (r + 1) n), and each calls its comm with its microbatch's whole gradient as fully_shard lays it out (row s
    for rank s); the all-to-all hands rank r row r of every rank's input."""
    n = len(grads) // world
    inputs: dict[int, torch.Tensor] = {}

    def exchange_for(rank: int) -> Any:
        return lambda tensor, group: torch.stack([inputs[s].view(world, -1)[rank] for s in range(world)]).view(-1)

    comms = [FixedOrderReduceScatter(n, exchange_for(r)) for r in range(world)]
    group: Any = SimpleNamespace(size=lambda: world)
    outputs = [torch.full((grads[0].numel() // world,), float("nan")) for _ in range(world)]
    for k in range(n):
        inputs.clear()
        inputs.update({r: grads[r * n + k].clone() for r in range(world)})
        for r in range(world):
            comms[r](outputs[r], inputs[r], group)
            if k < n - 1:  # the earlier microbatches output zeros: the trainer clears them before the next
                assert not outputs[r].any()
    return outputs


def test_fixed_order_reduce_scatter_gives_the_same_bits_at_every_shard_count() -> None:
    M, numel = 8, 64
    grads = _grads(M, numel)
    tree = _tree_sum([[g.clone()] for g in grads])[0]  # one process, M microbatches of accumulation
    for world in (1, 2, 4, 8):
        shards = _simulated_fsdp(grads, world)
        assert torch.equal(torch.cat(shards), tree), world
    # the test can fail: a sum in another order (fully_shard's accumulation, then a ring) gives other bits
    sequential = grads[0].clone()
    for g in grads[1:]:
        sequential += g
    assert not torch.equal(sequential, tree)


def test_fixed_order_reduce_scatter_refuses_no_microbatches_and_an_incomplete_tree() -> None:
    with pytest.raises(UsageError, match="must be positive"):
        FixedOrderReduceScatter(0)
    # a module that one microbatch did not use: 1 call of 2, its tree would take the next step's contributions
    comm = FixedOrderReduceScatter(2, lambda tensor, group: tensor)
    comm(torch.empty(4), torch.ones(4), SimpleNamespace(size=lambda: 1))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="received 1 of its 2 microbatches' gradients in a step"):
        check_complete([FixedOrderReduceScatter(2), comm])  # a complete (fresh) one and the incomplete one
    assert not comm.received  # the next step starts afresh


def test_a_stage_sums_its_microbatches_as_one_process_does_whatever_the_schedule() -> None:
    """detrace.parallel.pipeline on one stage, schedules emulated: GPipe (every forward, then every backward) and
    1F1B-like (each forward then its backward) give invariant_backward's bits, dropout included."""
    from torch import nn

    from detrace.parallel.data import invariant_backward, step_seed
    from detrace.parallel.pipeline import SeededForwards, TreeGradients

    M = 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, 4, 16, generator=g) * 10.0 ** torch.randint(-2, 3, (M, 4, 16), generator=g)
    y = torch.randint(0, 4, (M, 4), generator=g)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 4))

    def loss(m: nn.Module, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x[i]), y[i]) / M

    one = model()
    torch.manual_seed(5)
    invariant_backward(one, lambda i: loss(one, i), microbatches=M)
    expected = [p.grad.clone() for p in one.parameters()]  # type: ignore[union-attr]
    for gpipe in (True, False):
        stage = model()
        grads, seeds = TreeGradients(stage.parameters(), M), SeededForwards(stage, torch.device("cpu"))
        torch.manual_seed(5)
        seeds.begin(step_seed())
        grads.begin()
        if gpipe:
            for out in [loss(stage, i) for i in range(M)]:
                out.backward()
        else:
            for i in range(M):
                loss(stage, i).backward()
        grads.finish()
        assert all(torch.equal(p.grad, e) for p, e in zip(stage.parameters(), expected, strict=True)), gpipe
    # the control: autograd's own accumulation (a running sum) gives other bits
    plain = model()
    seeds = SeededForwards(plain, torch.device("cpu"))
    torch.manual_seed(5)
    seeds.begin(step_seed())
    for i in range(M):
        loss(plain, i).backward()
    assert not all(torch.equal(p.grad, e) for p, e in zip(plain.parameters(), expected, strict=True))
    with pytest.raises(UsageError, match="received 1 gradients in a step of 8"):
        grads.begin()
        loss(stage, 0).backward()
        grads.finish()


def test_the_chunked_layers_grad_norm_at_t1_is_summed_as_at_every_t(monkeypatch: pytest.MonkeyPatch) -> None:
    # at T > 1 the printed norm sums one square per parameter of the whole model by global name, as one vector
    # (`by_global_name`); one process (1x1, tp1) must sum them the same way, or it prints other last bits than 2x2,
    # fsdp2xtp2 and pp2xtp2 (as it did when it summed them in module order)
    from dataclasses import replace

    from detrace.parallel.tensor import by_global_name
    from detrace.workload import layouts
    from detrace.workload.model import PRESETS, ModelConfig
    from detrace.workload.sharding import ParallelModel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = PRESETS["tiny"]["model"]
    assert isinstance(base, ModelConfig)
    pm = ParallelModel(replace(base, dispatch="fixed"), layouts.setup("tp-invariant"), seed=0, batch_size=8,
                       seq_len=32, microbatches=4)
    g = torch.Generator().manual_seed(0)
    for p in pm.raw.parameters():  # gradients of unequal scales: the sum of their squares depends on its order
        p.grad = torch.randn(p.shape, generator=g) * (1.0 + torch.rand((), generator=g))
    pm._invariant_sums = torch.zeros(3)  # the step's logged sums (metrics reads them with the gradients)
    squares = {n: p.grad.float().square().sum() for n, p in pm.raw.named_parameters() if p.grad is not None}
    in_module_order = torch.zeros(())
    for value in squares.values():
        in_module_order += value
    by_name = by_global_name(pm.raw, squares, dtype=torch.float32).sum()
    assert in_module_order.item() != by_name.item()  # the two orders give other bits here: the check below can fail
    assert pm.metrics()["grad_norm"].item() == by_name.sqrt().item()


def test_fully_shard_at_one_process_sums_every_microbatch_in_the_tree(tmp_path: Any) -> None:
    """At one shard fully_shard copies each microbatch's gradient into the shard and never calls the reduce-scatter:
    the recipe must still leave the tree over all M microbatches, not the last microbatch's gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from detrace.parallel import invariant_backward, shard_invariantly

    M = 4
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(M, 3, 8), torch.randn(M, 3, 1)

    def loss_of(model: torch.nn.Module, i: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x[i]), y[i]) / M

    leaves = []
    for i in range(M):
        plain.zero_grad(set_to_none=True)
        loss_of(plain, i).backward()
        leaves.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
    expected = _tree_sum(leaves)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(plain)
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(sharded[0], mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        comms = shard_invariantly(sharded, microbatches=M)
        for _ in range(2):  # a second step starts from a fresh tree
            invariant_backward(sharded, lambda i: loss_of(sharded, i), microbatches=M, sharded=True)
            check_complete(comms)
            grads = [p.grad.to_local() for p in sharded.parameters()]  # type: ignore[union-attr]
            assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    finally:
        dist.destroy_process_group()
