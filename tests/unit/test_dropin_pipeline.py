"""detrace.parallel's pipeline schedules as drop-ins for torch's: in process, at one stage and at two stages on one
process (the tree over the microbatches, the refusals); tests/e2e/test_dropin_pipeline_llama.py runs them for real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe as TorchScheduleGPipe
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble as TorchScheduleInterleavedZeroBubble
from torch.distributed.pipelining import ScheduleZBVZeroBubble as TorchScheduleZBVZeroBubble

from detrace.errors import UsageError
from detrace.parallel import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    TreeGradients,
)
from detrace.parallel.data import _tree_sum

M, B = 4, 2


def _model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Dropout(dropout), nn.Linear(64, 3))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M * B, 8, generator=g) * 10, torch.randint(0, 3, (M * B,), generator=g)


def _stage(model: nn.Module) -> Any:
    return PipelineStage(model, 0, 1, torch.device("cpu"))


def _tree_of_microbatches(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One process: each microbatch's gradient of its loss / M alone, summed (g0 + g1) + (g2 + g3)."""
    model, per = _model(), []
    for i in range(M):
        loss = _loss(model(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) / M
        per.append(torch.autograd.grad(loss, list(model.parameters())))
    return [(a + b) + (c + d) for a, b, c, d in zip(*per, strict=True)]


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_schedule_sums_a_stages_microbatches_in_the_tree(one_rank: None, schedule: Any) -> None:
    differs = False
    for seed in range(8):
        x, y = _batch(seed)
        want = _tree_of_microbatches(x, y)
        model = _model()
        losses: list[torch.Tensor] = []
        schedule(_stage(model), n_microbatches=M, loss_fn=_loss).step(x, target=y, losses=losses)
        reference = _model()
        for i, loss in enumerate(losses):  # the loss function's own values, not the loss / M it ran backward from
            assert torch.equal(loss, _loss(reference(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]))
        for p, g in zip(model.parameters(), want, strict=True):
            assert torch.equal(p.grad, g)
        # torch's own schedule adds the microbatches in running order: a different sum, for some batch
        torch_model = _model()
        TorchScheduleGPipe(_stage(torch_model), n_microbatches=M, loss_fn=_loss).step(x, target=y)
        differs |= any(not torch.equal(p.grad, g) for p, g in zip(torch_model.parameters(), want, strict=True))
    assert differs


def test_schedule_refuses_what_it_cannot_keep_in_one_sentence(one_rank: None) -> None:
    x, y = _batch(0)
    model = _model()
    schedule = Schedule1F1B(_stage(model), n_microbatches=M, loss_fn=_loss)
    schedule.step(x, target=y)
    kept = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(UsageError, match=r"call optimizer\.zero_grad"):
        schedule.step(x, target=y)
    # the refusal lost nothing
    assert all(torch.equal(p.grad, k) for p, k in zip(model.parameters(), kept, strict=True))
    model.zero_grad()
    schedule.step(x, target=y)  # after zero_grad, it runs
    dropped = _model(dropout=0.1)
    with pytest.raises(UsageError, match="does not support dropout"):
        ScheduleGPipe(_stage(dropped), n_microbatches=M, loss_fn=_loss).step(x, target=y)


def test_schedule_leaves_a_sharded_modules_gradients_to_fully_shard(one_rank: None) -> None:
    """A stage whose blocks are given to detrace's fully_shard: their gradients are fully_shard's tree (the schedule's
    own tree must not take them again), the bits of the plain loop of M backwards of loss / M on the model sharded
    whole (its root too, as examples/llama_parallel.py's one process: every gradient the tree)."""
    from torch.distributed.tensor import DTensor

    from detrace.parallel import fully_shard

    x, y = _batch(1)
    loop = _model()
    fully_shard(loop[0])
    fully_shard(loop)
    for i in range(M):
        (_loss(loop(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) / M).backward()
    staged = _model()
    fully_shard(staged[0])
    ScheduleGPipe(_stage(staged), n_microbatches=M, loss_fn=_loss).step(x, target=y)
    wants = dict(loop.named_parameters())
    for name, p in staged.named_parameters():
        got, want = p.grad, wants[name].grad
        assert got is not None and want is not None
        got = got.full_tensor() if isinstance(got, DTensor) else got
        assert torch.equal(got, want.full_tensor() if isinstance(want, DTensor) else want), name


def _deep_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))


def _tree_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> list[torch.Tensor]:
    """One process: each of the m microbatches' gradient of its loss / m alone, summed in data.py's fixed tree."""
    per = []
    for i in range(m):
        loss = _loss(model(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) / m
        per.append(list(torch.autograd.grad(loss, list(model.parameters()))))
    return _tree_sum(per)


@pytest.mark.parametrize("schedule", [ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
                                      ScheduleZBVZeroBubble])
def test_multi_stage_schedules_sum_each_stages_microbatches_in_the_tree(one_rank: None, schedule: Any) -> None:
    """Two stages on one process (the V of ZBV puts both on a rank), M = 3 (not a power of two: a tree that
    reversing changes, as torch's LoopedBFS runs a stage's backwards 2, 1, 0), the zero-bubble ones splitting each
    backward into input and weight steps: every gradient is the one process's tree, the losses the loss function's
    own; torch's schedule differs."""
    torch_schedule = getattr(torch.distributed.pipelining, schedule.__name__)
    m, differs = 3, False
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(m * B, 8, generator=g) * 10, torch.randint(0, 3, (m * B,), generator=g)
        want = _tree_of(_deep_model(), x, y, m)
        model, losses = _deep_model(), []
        stages = [PipelineStage(part, i, 2, torch.device("cpu")) for i, part in enumerate((model[0:2], model[2:5]))]
        schedule(stages, n_microbatches=m, loss_fn=_loss).step(x, target=y, losses=losses)
        reference = _deep_model()
        assert [loss.item() for loss in losses] == [_loss(reference(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]).item()
                                                    for i in range(m)]
        for p, w in zip(model.parameters(), want, strict=True):
            assert torch.equal(p.grad, w)
        theirs = _deep_model()
        stages = [PipelineStage(part, i, 2, torch.device("cpu")) for i, part in enumerate((theirs[0:2], theirs[2:5]))]
        torch_schedule(stages, n_microbatches=m, loss_fn=_loss).step(x, target=y)
        differs |= any(not torch.equal(p.grad, w) for p, w in zip(theirs.parameters(), want, strict=True))
    assert differs


def test_interleaved_stages_leave_fully_shard_to_its_tree_and_zero_bubble_refuses_it(one_rank: None) -> None:
    """Stages whose blocks are given to detrace's fully_shard: ScheduleInterleaved1F1B gives the loop's bits on the
    model sharded whole; a zero-bubble schedule's split backward cannot run on them, refused in one sentence."""
    from torch.distributed.tensor import DTensor

    from detrace.parallel import fully_shard

    x, y = _batch(2)
    loop = _deep_model()
    for i in (0, 2, 4):
        fully_shard(loop[i])
    fully_shard(loop)
    for i in range(M):
        (_loss(loop(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) / M).backward()
    staged = _deep_model()
    for i in (0, 2, 4):
        fully_shard(staged[i])
    stages = [PipelineStage(part, i, 2, torch.device("cpu")) for i, part in enumerate((staged[0:2], staged[2:5]))]
    with pytest.raises(UsageError, match=r"ScheduleZBVZeroBubble splits stage \d's backward .* fully_shard"):
        ScheduleZBVZeroBubble(stages, n_microbatches=M, loss_fn=_loss)
    ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=_loss).step(x, target=y)
    wants = dict(loop.named_parameters())
    for name, p in staged.named_parameters():
        got, want = p.grad, wants[name].grad
        assert got is not None and want is not None
        got = got.full_tensor() if isinstance(got, DTensor) else got
        assert torch.equal(got, want.full_tensor() if isinstance(want, DTensor) else want), name


@pytest.mark.parametrize("leaves", range(1, 10))
def test_tree_gradients_sum_any_backward_order_in_the_one_tree(leaves: int) -> None:
    """Each microbatch's gradient takes its own leaf, in whatever order a schedule delivers them: the bits of
    data.py's tree over the microbatches in order, and a backward order that is not each microbatch once is refused."""
    g = torch.Generator().manual_seed(leaves)
    grads = [torch.randn(5, generator=g) * 10 ** torch.randint(-3, 4, (5,), generator=g) for _ in range(leaves)]
    want = _tree_sum([[t.clone()] for t in grads])[0]
    for order in (list(range(leaves)), list(range(leaves))[::-1],
                  torch.randperm(leaves, generator=g).tolist()):
        param = nn.Parameter(torch.zeros(5))
        tree = TreeGradients([param], leaves, order=order)
        tree.begin()
        for k in order:
            (param * grads[k]).sum().backward()
        tree.finish()
        assert torch.equal(param.grad, want), order
    with pytest.raises(UsageError, match="each of its 3 microbatches once"):
        TreeGradients([nn.Parameter(torch.zeros(1))], 3, order=[0, 0, 2])


@pytest.mark.parametrize("schedule", [ScheduleZBVZeroBubble, ScheduleLoopedBFS, TorchScheduleZBVZeroBubble,
                                      TorchScheduleInterleavedZeroBubble])
def test_a_multi_stage_step_is_traced_as_the_loop_of_its_microbatches(one_rank: None, tmp_path: Path,
                                                                      schedule: Any) -> None:
    """Each microbatch's loss (the root: loss / M for detrace's schedules, the loss for torch's, which divide the
    gradients after) is recorded in microbatch order as a loop's would be, and the backward's records are in phase
    backward: a zero-bubble schedule's input and weight steps run through torch.autograd.grad, where the tracer
    sees no backward of its own (it wraps the stage's two steps, torch's schedules' as detrace's), and torch's
    LoopedBFS runs a stage's backwards in reverse order (detrace's runs them in order, so that loss k is microbatch
    k)."""
    import detrace
    from detrace.tracefile import read_rank

    x, y = _batch(3)
    model, losses = _deep_model(), []
    with detrace.trace(tmp_path / "run", rung="module"):
        stages = [PipelineStage(part, i, 2, torch.device("cpu")) for i, part in enumerate((model[0:2], model[2:5]))]
        schedule(stages, n_microbatches=M, loss_fn=_loss).step(x, target=y, losses=losses)
    rows = read_rank(tmp_path / "run", 0).table.to_pylist()
    scale = 1 if schedule.__module__.startswith("torch.") else M
    assert [r["value"] for r in rows if r["name"] == "loss"] == [(loss / scale).item() for loss in losses]
    grads = [r for r in rows if r["rung"] == "module" and r["role"] in ("grad_input", "grad_output")]
    assert {r["module"] for r in grads} >= {"2", "4"}  # the split stage's layers, seen in the backward
    assert all(r["phase"] == "backward" for r in grads)


def test_schedules_read_torchs_arguments_where_torchs_signature_puts_them(one_rank: None) -> None:
    """scale_grads=False given by position (GPipe's seventh argument, LoopedBFS's fifth: their signatures differ) or
    by name is torch's meaning: the loss function's value is the root, each microbatch's gradient not divided by M."""
    x, y = _batch(4)

    def grads(make: Any) -> list[torch.Tensor]:
        model = _deep_model()
        make(model).step(x, target=y)
        return [p.grad for p in model.parameters()]

    def two(model: nn.Sequential) -> list[Any]:
        return [PipelineStage(part, i, 2, torch.device("cpu")) for i, part in enumerate((model[0:2], model[2:5]))]

    summed = grads(lambda m: ScheduleGPipe(_stage(m), M, _loss, None, None, None, False))
    assert all(torch.equal(a, b) for a, b in zip(
        summed, grads(lambda m: ScheduleGPipe(_stage(m), M, _loss, scale_grads=False)), strict=True))
    averaged = grads(lambda m: ScheduleGPipe(_stage(m), M, _loss))
    assert not any(torch.equal(a, b) for a, b in zip(summed, averaged, strict=True))
    looped = grads(lambda m: ScheduleLoopedBFS(two(m), M, _loss, None, False))
    assert all(torch.equal(a, b) for a, b in zip(
        looped, grads(lambda m: ScheduleLoopedBFS(two(m), M, loss_fn=_loss, scale_grads=False)), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(looped, summed, strict=True))  # one tree, whatever the schedule
