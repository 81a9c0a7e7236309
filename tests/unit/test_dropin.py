"""detrace.parallel's drop-in replacements for torch's parallel APIs: `fully_shard` with torch's signature, whose
gradients are the fixed tree over global microbatches at every number of shards (in process at one shard; the
ranks spawned at 2 and 4); `parallelize_module` with `ColwiseParallel` and `RowwiseParallel`, the same bits at tp1,
tp2 and fsdp2xtp2 with the model's names and shapes; and what they refuse."""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _ranks import spawn_ranks
from torch.distributed.device_mesh import init_device_mesh

from detrace.errors import UsageError
from detrace.parallel.data import _tree_sum

M = 8


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(M, 3, 8, generator=g), torch.randn(M, 3, 1, generator=g)


def _shard(model: torch.nn.Sequential, fully_shard: Callable[..., Any], world: int, replicas: int = 0) -> None:
    """fully_shard on a 1-D mesh of `world` ranks, or with `replicas`, on HSDP's 2-D mesh (replicas, world /
    replicas)."""
    if replicas:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(model: torch.nn.Module, rank: int, world: int, steps: int) -> list[torch.Tensor]:
    """torchtitan's gradient accumulation: rank r runs global microbatches [r n, (r + 1) n), each loss scaled by
    1 / n, one backward each; returns the whole parameters after the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = M // world
    for step in range(steps):
        x, y = _batch(step)
        for i in range(rank * n, (rank + 1) * n):
            (torch.nn.functional.mse_loss(model(x[i]), y[i]) / n).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def _digest(params: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()


def test_fully_shard_at_one_process_leaves_the_tree_over_the_microbatches(one_rank: None) -> None:
    """At one shard torch copies each microbatch's gradient and adds the copies in running order; the drop-in leaves
    the balanced tree over the M microbatches (what every other number of shards gives), at every step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from detrace.parallel import fully_shard

    plain = _model()
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    _shard(ours, fully_shard, 1)
    _shard(theirs, torch_fully_shard, 1)
    for step in range(2):
        x, y = _batch(step)
        leaves = []
        for i in range(M):
            plain.zero_grad(set_to_none=True)
            (torch.nn.functional.mse_loss(plain(x[i]), y[i]) / M).backward()
            leaves.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
        expected = _tree_sum(leaves)
        for model in (ours, theirs):
            for i in range(M):
                (torch.nn.functional.mse_loss(model(x[i]), y[i]) / M).backward()
        got = [p.grad.to_local() for p in ours.parameters()]  # type: ignore[union-attr]
        running = [p.grad.to_local() for p in theirs.parameters()]  # type: ignore[union-attr]
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        assert not all(torch.equal(g, e) for g, e in zip(running, expected, strict=True))  # the check can fail
        for param, grad in zip(plain.parameters(), expected, strict=True):
            param.grad = grad
        for model in (ours, theirs, plain):  # the next step starts a new tree
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("skip_sync", ["set_requires_gradient_sync", "set_requires_all_reduce"])
def test_fully_shard_on_hsdps_mesh_with_sync_skipped_between_microbatches_leaves_the_tree(
        one_rank: None, skip_sync: str) -> None:
    """HSDP's 2-D mesh (replicate, shard) at one process, in torch's gradient accumulation without communication
    (sync off but for the last microbatch): the parameters are torch's HSDP placements and the gradients the
    balanced tree over the M microbatches, as on a 1-D mesh; torch's own fully_shard adds them in running order."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard

    from detrace.parallel import fully_shard

    plain = _model()
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    _shard(ours, fully_shard, 1, replicas=1)
    _shard(theirs, torch_fully_shard, 1, replicas=1)
    assert ours[0].weight.placements == (Replicate(), Shard(0))  # type: ignore[union-attr]
    x, y = _batch(0)
    leaves = []
    for i in range(M):
        plain.zero_grad(set_to_none=True)
        (torch.nn.functional.mse_loss(plain(x[i]), y[i]) / M).backward()
        leaves.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
    expected = _tree_sum(leaves)
    for model in (ours, theirs):
        for i in range(M):
            getattr(model, skip_sync)(i == M - 1)
            (torch.nn.functional.mse_loss(model(x[i]), y[i]) / M).backward()
    got = [p.grad.to_local() for p in ours.parameters()]  # type: ignore[union-attr]
    running = [p.grad.to_local() for p in theirs.parameters()]  # type: ignore[union-attr]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not all(torch.equal(g, e) for g, e in zip(running, expected, strict=True))  # the check can fail


@pytest.mark.parametrize("api", ["detrace", "torch"])
def test_a_sharded_pipeline_stage_module_gets_the_tree_from_either_schedule(one_rank: None, api: str) -> None:
    """torch's pipeline stage runs a fully_shard stage module with gradient sync and resharding after backward off
    between microbatches, and reduces it itself after the last: the gradients are the tree over the M microbatches
    (scaled by 1 / M, an exact power of two). The stage's module stays unsharded from one backward to the next, so
    its attributes are the unsharded parameters: clearing those instead of the sharded ones added each tree's
    partial sum to the one before, silently."""
    import torch.distributed.pipelining as torch_pipelining

    import detrace.parallel as detrace_pipelining
    from detrace.parallel import fully_shard

    source: Any = detrace_pipelining if api == "detrace" else torch_pipelining
    plain = _model()
    model = copy.deepcopy(plain)
    _shard(model, fully_shard, 1)
    x, y = _batch(0)
    leaves = []
    for i in range(M):
        plain.zero_grad(set_to_none=True)
        (torch.nn.functional.mse_loss(plain(x[i]), y[i]) / M).backward()
        leaves.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
    stage = source.PipelineStage(model, 0, 1, torch.device("cpu"))
    source.ScheduleGPipe(stage, n_microbatches=M, loss_fn=torch.nn.functional.mse_loss).step(
        x.flatten(0, 1), target=y.flatten(0, 1))
    got = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
    assert all(torch.equal(g, e) for g, e in zip(got, _tree_sum(leaves), strict=True))


def test_fully_shard_refuses_what_it_cannot_keep_in_one_sentence(one_rank: None) -> None:
    from detrace.parallel import fully_shard

    model = _model()
    with pytest.raises(UsageError, match="one module, not a list"):
        fully_shard([model[0], model[2]])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"a 1-D mesh, or a 2-D one for HSDP \(replicate, shard\), not a 3-D one"):
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "fsdp", "tp")))
    with pytest.raises(UsageError, match="does not support dp_mesh_dims"):
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)), dp_mesh_dims=object())
    _shard(model, fully_shard, 1)
    with pytest.raises(UsageError, match="custom reduce-scatter"):
        model.set_custom_reduce_scatter(object())  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0)
    for i in range(3):
        torch.nn.functional.mse_loss(model(x[i]), y[i]).backward()
    with pytest.raises(UsageError, match="received 3 microbatches in a step; each rank must run a power-of-two"):
        optimizer.step()
    for i in range(2):  # the refused step's tree is dropped: the next step is complete
        torch.nn.functional.mse_loss(model(x[i]), y[i]).backward()
    optimizer.step()


def _ranks(rank: int, world: int, out: str, api: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if api == "detrace":
            from detrace.parallel import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        # HSDP in the same ranks: (2, 2) with either import, and (4, 1), where torch never calls the reduce-scatter
        # (with force-sum reductions too: torch then divides after the all-reduce hook, not in its collectives)
        meshes = [(0, False)] + ([(2, False), (4, False), (4, True)] if api == "detrace" and world == 4
                                 else [(2, False)] if world == 4 else [])
        for replicas, force_sum in meshes:
            model = _model()
            _shard(model, fully_shard, world, replicas)
            if force_sum:
                for module in (model[0], model[2], model):
                    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
            params = _train(model, rank, world, steps=2)  # rank (r, s) runs data index r S + s: the global rank
            if rank == 0:
                name = f"{api}{world}{f'-dp{replicas}' if replicas else ''}{'-sum' if force_sum else ''}"
                (Path(out) / name).write_text(_digest(params))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fully_shard_gives_one_process_bits_at_two_and_four_shards(tmp_path: Path, one_rank: None) -> None:
    """The same loop, the same bits at 1, 2 and 4 shards and on HSDP's (2, 2) and (4, 1) meshes with detrace's
    import; torch's own differs (the control), on HSDP's (2, 2) mesh too."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from detrace.parallel import fully_shard

    model = _model()
    _shard(model, fully_shard, 1)
    reference = _digest(_train(model, 0, 1, steps=2))
    for world in (2, 4):
        for api in ("detrace", "torch"):
            spawn_ranks(_ranks, (world, str(tmp_path), api), nprocs=world, timeout=240)
    theirs = _model()
    _shard(theirs, torch_fully_shard, 1)
    assert _digest(_train(theirs, 0, 1, steps=2)) != reference
    for world in (2, 4):
        assert (tmp_path / f"detrace{world}").read_text() == reference, world
        assert (tmp_path / f"torch{world}").read_text() != reference, world
    assert (tmp_path / "detrace4-dp2").read_text() == reference
    assert (tmp_path / "detrace4-dp4").read_text() == reference
    assert (tmp_path / "detrace4-dp4-sum").read_text() == reference
    assert (tmp_path / "torch4-dp2").read_text() != reference


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8, bias=False)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


class _RMSNorm(torch.nn.Module):
    """Llama's norm: per token, its weight times x / rms(x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_sequence_parallel_sums_a_norms_gradients_in_the_tree_over_fixed_sequence_chunks(one_rank: None,
                                                                                          norm: str) -> None:
    """At one process the style runs the norm on each of its 8 chunks of the sequence alone and adds the chunks'
    parameter gradients in the balanced tree: by hand, the plain norm on each chunk and the tree of its gradients
    (torch's sums the 64 tokens at once). The output and the input gradient are the plain norm's, token by token."""
    from torch.distributed.tensor import DTensor, Shard

    from detrace.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    plain = torch.nn.LayerNorm(16) if norm == "layer" else _RMSNorm(16)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
    model = copy.deepcopy(plain)
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"": SequenceParallel()})
    x, g = torch.randn(2, 32, 16, requires_grad=True), torch.randn(2, 32, 16)
    y = model(x)
    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    y.to_local().backward(g)
    outs, input_grads, chunk_grads = [], [], []
    for xj, gj in zip(x.detach().split(4, dim=1), g.split(4, dim=1), strict=True):
        xj = xj.clone().requires_grad_()
        plain.zero_grad()
        out = plain(xj)
        out.backward(gj.clone())
        outs.append(out.detach())
        input_grads.append(xj.grad)
        chunk_grads.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
    for k, p in enumerate(model.parameters()):
        leaves = [grads[k] for grads in chunk_grads]
        while len(leaves) > 1:  # ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))
            leaves = [a + b for a, b in zip(leaves[::2], leaves[1::2], strict=True)]
        assert torch.equal(p.grad.to_local(), leaves[0])  # type: ignore[union-attr]
    assert torch.equal(y.to_local(), torch.cat(outs, dim=1))
    assert torch.equal(x.grad, torch.cat(input_grads, dim=1))  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [2, 4])
def test_sequence_parallel_at_one_process_gives_the_bits_of_each_ranks_block_added_in_the_tree(one_rank: None,
                                                                                              ranks: int) -> None:
    """Rank t of T runs its block of the sequence in its chunks / T chunks, as one process running that block with
    SequenceParallel(chunks=8 // T); the ranks' sums are then added in the tree over the ranks. So at one process
    the style gives what T ranks give (the chunks' gradients added in running order instead give other bits here)."""
    from detrace.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    plain = torch.nn.LayerNorm(16)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
    mesh = init_device_mesh("cpu", (1,))
    x, g = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    whole = parallelize_module(copy.deepcopy(plain), mesh, SequenceParallel())
    whole(x).to_local().backward(g)
    blocks = []
    for xt, gt in zip(x.split(64 // ranks, dim=1), g.split(64 // ranks, dim=1), strict=True):
        block = parallelize_module(copy.deepcopy(plain), mesh, SequenceParallel(chunks=8 // ranks))
        block(xt).to_local().backward(gt)
        blocks.append([p.grad.to_local() for p in block.parameters()])  # type: ignore[union-attr]
    for k, p in enumerate(whole.parameters()):
        leaves = [grads[k] for grads in blocks]
        while len(leaves) > 1:
            leaves = [a + b for a, b in zip(leaves[::2], leaves[1::2], strict=True)]
        assert torch.equal(p.grad.to_local(), leaves[0])  # type: ignore[union-attr]


def test_sequence_parallel_layouts_refuse_what_they_cannot_keep_in_one_sentence(one_rank: None) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from detrace.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    norm = parallelize_module(torch.nn.LayerNorm(8), mesh, SequenceParallel())
    with pytest.raises(UsageError, match=r"SequenceParallel\(chunks=8\) must divide the sequence length \(12\)"):
        norm(torch.randn(2, 12, 8))
    with pytest.raises(UsageError, match=r"shards the sequence on dimension 1 .*, not 0"):
        SequenceParallel(sequence_dim=0)
    with pytest.raises(UsageError, match="whose parameters are its own"):
        parallelize_module(torch.nn.Sequential(torch.nn.LayerNorm(8)), mesh, SequenceParallel())
    layer = parallelize_module(torch.nn.Linear(8, 8), mesh, ColwiseParallel(input_layouts=Shard(1)))
    replicated = DTensor.from_local(torch.randn(2, 8, 8), mesh, [Replicate()], run_check=False)
    with pytest.raises(UsageError, match=r"takes its input as Shard\(dim=1\), not as a DTensor placed Replicate\(\)$"):
        layer(replicated)
    # at T = 1 the sequence-parallel layouts are the replicated ones: a gather and a slice of one rank
    x = torch.randn(2, 8, 8)
    sharded = copy.deepcopy(_MLP())
    parallelize_module(sharded, mesh, {"up": ColwiseParallel(input_layouts=Shard(1)),
                                       "down": RowwiseParallel(output_layouts=Shard(1))})
    whole = copy.deepcopy(_MLP())
    parallelize_module(whole, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert torch.equal(sharded(x), whole(x))


def _parallelize(model: torch.nn.Module, api: str, fsdp: int, tp: int) -> None:
    if api == "detrace":
        from detrace.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    mesh = init_device_mesh("cpu", (fsdp, tp), mesh_dim_names=("fsdp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])


def _train_2d(model: torch.nn.Module, block: int, blocks: int) -> str:
    """Two steps of 8 microbatches, of which this rank's data-parallel block runs its share."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = M // blocks
    for step in range(2):
        x, y = _batch(step)
        for i in range(block * n, (block + 1) * n):
            (torch.nn.functional.mse_loss(model(x[i]), y[i]) / n).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _digest([p.full_tensor().detach() for p in model.parameters()])  # type: ignore[operator]


def test_parallelize_module_keeps_the_models_names_and_shapes_and_refuses_in_one_sentence(one_rank: None) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from detrace.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plain = _MLP()
    model = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (1,))
    for plan in ({"up": TorchColwise()}, {"up": SequenceParallel()},
                 {"up": PrepareModuleInput(input_layouts=Partial(), desired_input_layouts=Replicate())}):
        with pytest.raises(UsageError, match=r"takes detrace's ColwiseParallel, RowwiseParallel, SequenceParallel "
                                             r"and ExpertParallel .*, not torch"):
            parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"takes a Replicate or a Shard\(1\) \(sequence-parallel\) input, not S"):
        ColwiseParallel(input_layouts=Shard(0))
    with pytest.raises(UsageError, match=r"gives a Replicate or a Shard\(1\) \(sequence-parallel\) output, not S"):
        RowwiseParallel(output_layouts=Shard(0))
    for style in (ColwiseParallel, RowwiseParallel):
        with pytest.raises(UsageError, match="chunks must be positive, not 0"):
            style(chunks=0)
    with pytest.raises(UsageError, match="must divide the layer's output features"):
        parallelize_module(copy.deepcopy(plain), mesh, {"head": ColwiseParallel()})
    with pytest.raises(UsageError, match="not a replicated one"):
        parallelize_module(copy.deepcopy(plain), mesh, {"up": RowwiseParallel(input_layouts=Replicate())})
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in plain.named_parameters()]
    assert all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a, b)
               for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True))


def _tp_ranks(rank: int, world: int, out: str, api: str, fsdp: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _MLP()
        _parallelize(model, api, fsdp, world // fsdp)
        digest = _train_2d(model, rank // (world // fsdp), fsdp)
        if rank == 0:
            (Path(out) / f"{api}-fsdp{fsdp}xtp{world // fsdp}").write_text(digest)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_parallelize_module_gives_tp1_bits_at_tp2_and_fsdp2xtp2(tmp_path: Path, one_rank: None) -> None:
    """detrace's plan and fully_shard: 1x1, tp2 and fsdp2xtp2 give the same parameters; torch's plan at tp2 gives
    other bits than at tp1 (the control)."""
    results = {}
    for api in ("detrace", "torch"):
        model = _MLP()
        _parallelize(model, api, 1, 1)
        results[api] = _train_2d(model, 0, 1)
    for api, world, fsdp in (("detrace", 2, 1), ("detrace", 4, 2), ("torch", 2, 1)):
        spawn_ranks(_tp_ranks, (world, str(tmp_path), api, fsdp), nprocs=world, timeout=240)
    assert (tmp_path / "detrace-fsdp1xtp2").read_text() == results["detrace"]
    assert (tmp_path / "detrace-fsdp2xtp2").read_text() == results["detrace"]
    assert (tmp_path / "torch-fsdp1xtp2").read_text() != results["torch"]


def test_a_strided_shard_is_a_box_only_when_later_shards_split_it_into_its_factor(one_rank: None) -> None:
    """fully_shard over a tensor-parallel weight places it as (_StridedShard(0, sf=T), Shard(0)): each rank holds a
    contiguous part of one tp block, whose fingerprint part the tracer records; alone, a strided shard is no box."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from detrace.digest.sharded import _boxed

    local = torch.arange(8.0).view(4, 2)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "tp"))
    lone = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(1)], run_check=False)
    assert not _boxed(lone)
    fsdp_over_tp = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=1), Shard(0)], run_check=False)
    assert _boxed(fsdp_over_tp)


def _parts_ranks(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from detrace.digest import fingerprint_many
        from detrace.digest.kernels import selected_scheme
        from detrace.digest.sharded import part_of, whole_digest

        scheme = selected_scheme()
        model = _MLP()
        _parallelize(model, "detrace", 2, 2)
        lines = []
        for name, param in model.named_parameters():
            if param.device_mesh.ndim == 1:  # type: ignore[attr-defined]  # the head: fully_shard's alone
                continue
            part = part_of(param, scheme)
            parts: list[int | None] = [None] * world
            dist.all_gather_object(parts, None if part is None else part.digest)
            whole = fingerprint_many([param.full_tensor()])[0].digest  # type: ignore[operator]
            found = sorted({p for p in parts if p is not None})
            lines.append(f"{name} {param.placements} {bool(found)} "  # type: ignore[attr-defined]
                         f"{bool(found) and whole_digest(found, param.dtype, tuple(param.shape), scheme) == whole}")
        if rank == 0:
            (Path(out) / "parts").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2xtp2_parameters_parts_complete_to_the_global_fingerprint(tmp_path: Path) -> None:
    """On fsdp2xtp2 every parameter sharded over both dimensions (the column-wise ones strided by fully_shard) has a
    part on each rank, and the distinct parts add up to the fingerprint of the gathered tensor."""
    spawn_ranks(_parts_ranks, (4, str(tmp_path)), nprocs=4, timeout=240)
    lines = (tmp_path / "parts").read_text().splitlines()
    assert any("_StridedShard" in line for line in lines), lines
    assert all(line.endswith("True True") for line in lines), lines
