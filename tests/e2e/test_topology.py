"""Same bits at any data-parallel world size: detrace.parallel.data's fixed-tree reduction, the trainer's
--parallel dp-invariant, and `detrace check-topology`."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _ranks import spawn_ranks
from _synthetic import TrainingStep, write_training_rank
from torch import nn

from detrace.cli import main as cli
from detrace.errors import CommandFailed, IncomparableError, UsageError
from detrace.investigate.check_topology import (
    Launch,
    Mesh,
    TopologyResult,
    check_topology,
    parse_layouts,
    parse_worlds,
    plan_runs,
    torchrun_command,
)
from detrace.investigate.validate import _topology_row
from detrace.launch.launcher import LaunchResult
from detrace.parallel.data import InvariantDataParallel, _tree_plan, invariant_backward, owned_microbatches
from detrace.parallel.layout import LAYOUT_ENV, Layout
from detrace.parallel.tensor import TP_ENV

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "invariant_dp.py"
M = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M, 8, 16, generator=g), torch.randint(0, 4, (M, 8), generator=g)


def _step(model: nn.Module, **kwargs: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One invariant step from a seeded global generator: (loss sum, gradients)."""
    x, y = _batch()
    torch.manual_seed(5)
    loss = invariant_backward(model, lambda i: nn.functional.cross_entropy(model(x[i]), y[i]) / M,
                              microbatches=M, **kwargs)  # type: ignore[arg-type]
    assert isinstance(loss, torch.Tensor)
    return loss, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_tree_plan_is_the_balanced_tree() -> None:
    # after each leaf, the additions that complete a node: ((0 1)(2 3)), ((0 (1 2))((3 (4 5))))
    assert _tree_plan(0, 4) == [0, 1, 0, 2]
    assert _tree_plan(0, 6) == [0, 0, 2, 0, 0, 3]
    assert _tree_plan(0, 1) == [0]


def test_one_rank_sums_its_microbatches_in_tree_order() -> None:
    model = _model()
    loss, grads = _step(model)
    # the same microbatch gradients by hand (each under the generator the step gives it), summed ((0+1)+(2+3))
    x, y = _batch()
    torch.manual_seed(5)
    base = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    leaves = []
    for i in range(M):
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((base + i * 0x9E3779B97F4A7C15) % (1 << 62))
            (nn.functional.cross_entropy(model(x[i]), y[i]) / M).backward()
        leaves.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    tree = [(a + b) + (c + d) for a, b, c, d in zip(*leaves, strict=True)]
    running = [((a + b) + c) + d for a, b, c, d in zip(*leaves, strict=True)]
    assert all(torch.equal(g, t) for g, t in zip(grads, tree, strict=True))
    assert not all(torch.equal(r, t) for r, t in zip(running, tree, strict=True))  # the order is what we fixed
    assert loss.shape == ()
    # the global generator moved by exactly one draw, whatever M is: the microbatches ran under their own
    assert torch.equal(torch.get_rng_state(), _after_one_draw(5))


def _after_one_draw(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    torch.randint(0, 1 << 62, (), dtype=torch.int64)
    return torch.get_rng_state()


def test_usage_errors() -> None:
    model = _model()
    with pytest.raises(UsageError, match="positive integer"):
        owned_microbatches(0)
    with pytest.raises(UsageError, match="exchange"):
        InvariantDataParallel(model, microbatches=2, exchange="ring")
    with pytest.raises(UsageError, match="scalar loss"):
        invariant_backward(model, lambda i: torch.ones(2, requires_grad=True), microbatches=2)
    with pytest.raises(UsageError, match="no parameter"):
        invariant_backward([], lambda i: torch.ones(()), microbatches=2)
    with pytest.raises(UsageError, match="values for some"):
        invariant_backward(model, lambda i: (model(torch.ones(1, 16)).sum(), torch.ones(1)) if i else
                           model(torch.ones(1, 16)).sum(), microbatches=2)
    for bad in ("1", "1,1", "0,2", "a,b"):
        with pytest.raises(UsageError):
            parse_worlds(bad)
    assert torchrun_command(["python", "t.py"], 2)[-4:] == ["--nproc-per-node=2", "--no-python", "python", "t.py"]


def _ranks(rank: int, out: str, port: int) -> None:
    """4 ranks: the world (W=4) and two groups of 2 (W=2, group-relative peers), each with both exchanges."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results = {}
    for world, group in ((4, None), (2, pair)):
        for how in ("doubling", "gather"):
            model = _model()
            idp = InvariantDataParallel(model, microbatches=M, group=group, exchange=how)
            x, y = _batch()
            torch.manual_seed(5)
            loss = idp.backward(lambda i, model=model, x=x, y=y: nn.functional.cross_entropy(model(x[i]), y[i]) / M)
            assert isinstance(loss, torch.Tensor)
            results[f"{world}-{how}"] = [loss, *(p.grad for p in model.parameters())]
    # replicas that start apart are refused
    torch.manual_seed(rank)
    try:
        InvariantDataParallel(nn.Linear(2, 2), microbatches=M)
        refused = ""
    except UsageError as err:
        refused = str(err)
    torch.save({"results": results, "refused": refused}, f"{out}/rank{rank}.pt")
    _elastic_checkpoints(rank, out)
    dist.barrier()
    dist.destroy_process_group()


def _elastic_checkpoints(rank: int, out: str) -> None:
    """The ranks save elastic checkpoints: with RNG states that differ (refused on every rank), then alike."""
    import random

    import numpy as np

    import detrace
    from detrace.errors import CheckpointError

    random.seed(0)  # every generator that TrainState saves: Python's and NumPy's alike on every rank
    np.random.seed(0)
    torch.manual_seed(0)
    state = detrace.TrainState(model=nn.Linear(3, 2), elastic=True)
    torch.manual_seed(rank)  # each rank's own generator state
    try:
        state.save(f"{out}/apart")
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    torch.manual_seed(7)
    state.step = 5
    state.save(f"{out}/alike")
    Path(f"{out}/refused{rank}.txt").write_text(refused)
    # each rank holds a part of one global model and optimizer, by global names (a pipeline stage's layers, a tp
    # rank's chunks): layers r and r + 1, so that every layer is on two ranks, whose copies must agree
    model, optimizer, scheduler = _parts({rank, (rank + 1) % 4}, steps=1)
    parts = detrace.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, elastic=True)
    parts.step = 1
    refusals = []
    kept = model["0"].weight.detach().clone() if rank == 3 else None
    for fault in ("weight", "lr"):  # a replica that differs, then a learning rate
        with torch.no_grad():
            if rank == 3 and fault == "weight":
                model["0"].weight[0, 0] += 1
            if rank == 3 and fault == "lr":
                model["0"].weight.copy_(kept)  # type: ignore[arg-type]
                optimizer.param_groups[0]["lr"] *= 2
        torch.manual_seed(7)
        try:
            parts.save(f"{out}/parts-apart")
            refusals.append("")
        except CheckpointError as err:
            refusals.append(str(err))
    optimizer.param_groups[0]["lr"] = scheduler.get_last_lr()[0]
    torch.manual_seed(7)
    parts.save(f"{out}/parts")
    Path(f"{out}/parts-refused{rank}.json").write_text(json.dumps(refusals))
    # the 4 ranks resume their parts, each rank the layers it holds; rank 0 alone reads the ranks' documents (which
    # names the global state holds) and hands the others their union: each of them reads only its own state's
    import detrace.state.ranks as ranks

    read, document = [], ranks.rank_document

    def counted(directory: Path, saved_rank: int, *, step: int) -> dict[str, object]:
        read.append(saved_rank)
        return document(directory, saved_rank, step=step)

    ranks.rank_document = counted  # type: ignore[assignment]
    model, optimizer, scheduler = _parts({rank, (rank + 1) % 4}, steps=0)
    step = detrace.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, elastic=True).load(
        f"{out}/parts")
    ranks.rank_document = document
    reference = _parts({rank, (rank + 1) % 4}, steps=1)[0]
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    Path(f"{out}/loaded{rank}.json").write_text(json.dumps({"step": step, "read": read, "same": same}))


def _parts(layers: set[int], *, steps: int) -> tuple[nn.ModuleDict, torch.optim.Optimizer, object]:
    """Layers `layers` of a model of linear layers (the others deleted, the names kept) with AdamW and a warmup,
    after `steps` steps of gradients that each parameter computes from itself (alike on every rank that holds it)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.ModuleDict({str(i): nn.Linear(3, 3) for i in range(max(layers) + 1)})
    for i in set(range(max(layers) + 1)) - layers:
        del model[str(i)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
    for _ in range(steps):
        _parts_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _parts_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 1
    optimizer.step()
    scheduler.step()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_world_sizes_1_2_4_give_the_same_bits_and_elastic_checkpoints_resume_at_any_world_size(
        tmp_path: Path) -> None:
    import detrace
    from detrace.errors import CheckpointError

    loss, grads = _step(_model())
    spawn_ranks(_ranks, (str(tmp_path),), nprocs=4, timeout=240)
    for rank in range(4):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert "rank 1 of the data-parallel group holds other parameters" in saved["refused"]
        assert sorted(saved["results"]) == ["2-doubling", "2-gather", "4-doubling", "4-gather"]
        for key, (got_loss, *got_grads) in saved["results"].items():
            assert torch.equal(got_loss, loss), key
            assert all(torch.equal(a, b) for a, b in zip(got_grads, grads, strict=True)), key
    # elastic checkpoints need the same state on every rank
    for rank in range(4):
        assert "needs the same own state" in (tmp_path / f"refused{rank}.txt").read_text()
    assert not (tmp_path / "apart").exists() or not any((tmp_path / "apart").glob("step-*"))
    # one process (world size 1) resumes the 4-rank checkpoint, elastic; a plain TrainState refuses it
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    assert detrace.TrainState(model=model, elastic=True).load(tmp_path / "alike") == 5
    assert torch.equal(torch.get_rng_state(), _seeded(7))  # rank 0's generator state (every rank's: alike)
    torch.manual_seed(0)
    assert torch.equal(model.weight, nn.Linear(3, 2).weight)
    with pytest.raises(CheckpointError, match="saved by 4 ranks and cannot resume 1"):
        detrace.TrainState(model=nn.Linear(3, 2)).load(tmp_path / "alike")
    # each rank saved its part of one global state; one process resumes the whole (DCP takes each name from a rank
    # that held it), and the whole model's next step is the one that model takes after a step of its own
    for rank in range(4):  # every rank refuses (the ranks that hold layer 0 name it; the others would wait forever)
        weight, lr = json.loads((tmp_path / f"parts-refused{rank}.json").read_text())
        assert "same model and optimizer values wherever two ranks hold one name" in weight and lr
        assert ("(first: 'model.0.weight')" if rank in (0, 3) else "(on other ranks)") in weight
        assert re.search(r"\(first: 'optimizer\.param_groups\.[03]\.(weight|bias)\.lr'\)", lr) if rank != 1 else \
            "(on other ranks)" in lr, lr
    for rank in range(4):  # resumed by the 4 ranks: each rank's document was read by rank 0, once
        loaded = json.loads((tmp_path / f"loaded{rank}.json").read_text())
        assert loaded == {"step": 1, "read": [0, 1, 2, 3] if rank == 0 else [0], "same": True}, (rank, loaded)
    model, optimizer, scheduler = _parts(set(range(4)), steps=0)
    assert detrace.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, elastic=True).load(
        tmp_path / "parts") == 1
    reference = _parts(set(range(4)), steps=1)
    for trained in (reference, (model, optimizer, scheduler)):
        _parts_step(*trained)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference[0].parameters(), strict=True))
    assert scheduler.get_last_lr() == reference[2].get_last_lr()  # type: ignore[attr-defined]
    # a model that lost a layer, or has one more, is refused
    for layers, message in ((set(range(3)), "holds tensor 'model.3.bias' that no rank of this training state has"),
                            (set(range(5)), "has tensor 'model.4.weight' that .* does not hold")):
        model, optimizer, scheduler = _parts(layers, steps=0)
        with pytest.raises(CheckpointError, match=message):
            detrace.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, elastic=True).load(
                tmp_path / "parts")


def _train_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str, **env: str) -> list[str]:
    from detrace.workload.train import main

    for key in ("DETRACE_CKPT_DIR", "DETRACE_STOP_AT", "DETRACE_RESUME", "DETRACE_RESUME_CONTROL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "ckpt"))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["--parallel", "dp-invariant", "--microbatches", "4", "--dispatch", "fixed", "--threads", "1",
                     "--steps", "3", *args]) == 0
    return [line for line in buf.getvalue().splitlines() if line.startswith(("step ", "final params"))]


@pytest.mark.slow
def test_trainer_resumes_exactly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    continuous = _train_lines(monkeypatch, tmp_path)
    assert _train_lines(monkeypatch, tmp_path, DETRACE_STOP_AT="1")[0] == continuous[0]
    resumed = _train_lines(monkeypatch, tmp_path, DETRACE_RESUME="1")
    assert resumed == continuous[1:]
    # without the RNG states the per-step draw (router jitter) changes: the check above could fail
    control = _train_lines(monkeypatch, tmp_path, DETRACE_RESUME="1", DETRACE_RESUME_CONTROL="skip-rng")
    assert control[0] != continuous[1]


def test_trainer_refuses_bad_options() -> None:
    from detrace.workload.train import main

    assert main(["--parallel", "dp-invariant", "--dispatch", "fixed"]) == 2  # no --microbatches
    assert main(["--microbatches", "2"]) == 2  # without dp-invariant
    assert main(["--parallel", "dp-invariant", "--microbatches", "2"]) == 2  # the racing index dispatch
    # 3 microbatches do not divide the batch of 8
    assert main(["--parallel", "dp-invariant", "--microbatches", "3", "--dispatch", "fixed"]) == 2
    assert main(["--parallel", "tp-invariant", "--dispatch", "fixed"]) == 2  # no --microbatches
    assert main(["--tp", "2", "--dispatch", "fixed"]) == 2  # --tp without a tp layout
    # T = 2 in one process (no torchrun)
    assert main(["--parallel", "tp-invariant", "--tp", "2", "--microbatches", "4", "--dispatch", "fixed"]) == 2


def test_trainer_takes_the_tp_size_from_check_topology(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from detrace.workload.train import main, parse_args

    monkeypatch.setenv(TP_ENV, "4")
    assert parse_args(["--parallel", "tp-invariant", "--microbatches", "4", "--dispatch", "fixed"]).tp == 4
    assert main(["--parallel", "tp-invariant", "--tp", "2", "--microbatches", "4", "--dispatch", "fixed"]) == 2
    assert "--tp 2 and DETRACE_TP=4 disagree" in capsys.readouterr().err


@pytest.mark.slow
def test_check_topology_finds_a_plain_loops_naive_reduction(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # Test-only fault: the example loop reducing the usual way (running-order accumulation, then all_reduce) gives
    # other bits at world 2 than at world 1. The invariant reduction's same bits at worlds 1, 2 and 4: the reference
    # workload's test below; the verdict's logic: the in-process tests above.
    code, report = _check_cli(capsys, tmp_path, "naive", "--worlds", "1,2", "--", sys.executable, str(LOOP),
                              "--steps", "2", "--reduce", "naive")
    assert code == 1, report
    first = report["first"]
    assert isinstance(first, dict) and first["step"] == 0 and first["world"] == 2
    assert first["kind"] in ("loss", "grad_norm", "param")


def test_check_topology_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["check-topology", "--worlds", "2"]) == 2
    assert cli(["check-topology", "--worlds", "1,2"]) == 2  # no CMD
    assert cli(["check-topology", "--worlds", "1,2", "--", "torchrun", "t.py"]) == 2
    assert cli(["check-topology", "--threads", "0", "--", "python", "t.py"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli(["check-topology", "--out", str(tmp_path / "full"), "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "without a launcher" in err and "not empty" in err and "Traceback" not in err


def test_runs_that_cannot_be_compared(tmp_path: Path) -> None:
    import detrace
    from detrace.errors import TraceError
    from detrace.investigate.check_topology import compare_runs

    with detrace.trace(tmp_path / "run", rung="semantic"):
        (torch.ones(3, requires_grad=True) * 2).sum().backward()  # a loss, but no optimizer step
    with pytest.raises(CommandFailed, match="no parameters"):
        compare_runs({1: tmp_path / "run"})
    with pytest.raises(TraceError, match="not of all 2 ranks"):
        compare_runs({2: tmp_path / "run"})


def test_runs_of_other_models_are_refused_naming_the_first_parameter_that_differs(tmp_path: Path) -> None:
    """Two models (a chunked layer against a whole one, another width) differ by construction, not by layout:
    check-topology refuses them in one sentence instead of calling the layouts divergent."""
    import detrace
    from detrace.investigate.check_topology import Run, compare

    def run(name: str, model: nn.Module) -> Run:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with detrace.trace(tmp_path / name, rung="semantic"):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        return Run(label=f"layout {name}", mesh=Mesh(dp=1), path=tmp_path / name)

    torch.manual_seed(0)
    whole = run("whole", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    torch.manual_seed(0)
    assert compare((whole, run("same", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))))[1] == [(None, None)]
    wider = r"^layout wider trains another model than layout whole, .*: parameter 0.bias is \[4\] in layout whole "
    with pytest.raises(IncomparableError, match=wider + r"and \[8\] in layout wider$"):
        compare((whole, run("wider", nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))))
    with pytest.raises(IncomparableError, match=r"parameter 2.bias is missing in layout whole and \[1\] in layout "
                                                r"deeper$"):
        compare((whole, run("deeper", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(1, 1)))))


def test_the_state_a_run_ended_with_is_compared_after_its_last_step(tmp_path: Path) -> None:
    """The tracer's final state (each parameter as the run ended): a change after the last optimizer step is found,
    named by parameter, at the end."""
    import detrace
    from detrace.investigate.check_topology import Run, compare

    def run(name: str, after: float) -> Run:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with detrace.trace(tmp_path / name, rung="semantic"):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            with torch.no_grad():
                model.bias.add_(after)  # after the last step: no optimizer record sees it
        return Run(label=f"layout {name}", mesh=Mesh(dp=1), path=tmp_path / name)

    reference = run("a", 0.0)
    _, compared, steps, tensors, _ = compare((reference, run("b", 0.0)))
    assert compared == [(None, None)] and (steps, tensors) == (1, 2)  # the end is not a step
    (first, _), = compare((reference, run("c", 1.0)))[1]
    assert first is not None and (first.kind, first.name, first.step) == ("final", "bias", -1)
    assert first.sentence("layout a").startswith("layout c differs from layout a at the end: tensor bias (")


# ----------------------------------------------------------------------------------------------------------
# check-topology's comparison and verdicts, in process: a launch that writes synthetic traces


@dataclass(frozen=True, kw_only=True)
class _Fake:
    """A command whose traces are those of a layout-invariant trainer (M = 4 microbatches, 3 steps, a layer in 2
    chunks split over tp and a replicated parameter), but for the injected faults, named as such."""

    steps: int = 3
    fault: tuple[str, int, str] | None = None
    """Injected fault: (run directory name, step, record name) gets other bits there: a parameter name, "loss"
    (microbatch 0's), "grad_norm", or "replica b" (tp rank 1's copy of the replicated b only)."""
    final: dict[str, str] = field(default_factory=dict)
    """Injected fault: the final params line printed by the run in that directory (default: the true one)."""
    param: tuple[str, int, str] | None = None
    """A second injected fault, like `fault`."""
    fail: str | None = None
    """Injected fault: the run in this directory exits 1."""
    lines: dict[str, str] = field(default_factory=dict)
    """More output of the run in that directory, before its final params line."""
    whole: tuple[str, ...] = ()
    """The runs in these directories train another model: `a` one whole parameter, not chunks."""
    average: bool = False
    """Each rank scales each microbatch's loss by 1/n for its n microbatches (torch's averaging convention)."""
    replicas: tuple[str, ...] = ()
    """The sharded runs in these directories hold every parameter whole on each rank (replicas, as an expert
    script's router), not each rank's plain shard of it (the reference trainer's flat shards)."""

    def __call__(self, argv: list[str], run: Path, env: dict[str, str], timeout: float | None) -> LaunchResult:
        assert env["OMP_NUM_THREADS"] == "1" and argv[-3:] == ["python", "train.py", "--x"]
        world = int(next(a for a in argv if a.startswith("--nproc-per-node=")).split("=")[1])
        tp = int(env.get(TP_ENV, "1"))
        first, last = 0, self.steps
        ckpt = Path(env.get("DETRACE_CKPT_DIR", run / "none")) / "step"
        if "DETRACE_STOP_AT" in env:
            last = int(env["DETRACE_STOP_AT"])
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(str(last))
        if env.get("DETRACE_RESUME") == "1":
            first = int(ckpt.read_text())
        per = M // (world // tp)  # microbatches per data-parallel rank
        layout = Layout.parse(env[LAYOUT_ENV]) if LAYOUT_ENV in env else None
        shards = 1 if layout is None or run.name in self.replicas else layout.size("fsdp") * layout.size("ep")

        def faulty(step: int, name: str) -> bool:
            return (run.name, step, name) in (self.fault, self.param)

        for rank in range(world):
            d, t = divmod(rank, tp)
            steps = []
            for s in range(first, last):
                scale = per if self.average else 1
                losses = tuple((s + i / 8 + (1e-9 if i == 0 and faulty(s, "loss") else 0)) / scale
                               for i in range(d * per, (d + 1) * per))
                params = {f"a.chunks.{j}": 100 * s + j + faulty(s, f"a.chunks.{j}")
                          for j in range(t * 2 // tp, (t + 1) * 2 // tp)} if run.name not in self.whole else {"a": 1}
                params["b"] = 100 * s + 7 + faulty(s, "b") + (t == 1 and faulty(s, "replica b"))
                if shards > 1:  # each rank's own part of every parameter, under its name: other bits, other shape
                    params = {name: digest + 1000 * (rank % shards) for name, digest in params.items()}
                steps.append(TrainingStep(step=s, losses=losses, params=params,
                                          grad_norm=float(t * 10 + s + faulty(s, "grad_norm")),
                                          shapes=dict.fromkeys(params, (4 // shards,))))
            write_training_rank(run, rank, steps, world_size=world)
        final = self.final.get(run.name, "0123456789abcdef")
        return LaunchResult(returncode=1 if self.fail == run.name else 0, out=run, command=tuple(argv), elapsed=0.1,
                            output_tail=f"step 3\n{self.lines.get(run.name, '')}final params {final}\n"
                            if last == self.steps else "step 2\n")


CMD = ["python", "train.py", "--x"]


def _topology(tmp_path: Path, fake: _Fake, layouts: str = "", worlds: str = "", resume_at: int | None = None
              ) -> TopologyResult:
    meshes = parse_layouts(layouts) if layouts else tuple(Mesh(dp=w) for w in parse_worlds(worlds))
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    return check_topology(CMD, meshes=meshes, out=out, resume_at=resume_at, tp_env=bool(layouts), launch=fake)


def test_layouts_compare_parameters_by_global_name_and_losses_by_microbatch(tmp_path: Path) -> None:
    result = _topology(tmp_path, _Fake(), layouts="1x1,1x2,2x2,2x1")
    assert result.identical and result.steps == 3 and result.tensors == 3
    assert [r.path.name for r in result.runs] == ["layout-1x1", "layout-1x2", "layout-2x2", "layout-2x1"]
    assert result.to_json()["layouts"] == ["1x1", "1x2", "2x2", "2x1"]
    # a chunk held by one tp rank, differing at step 1 of the 2x2 run: named, with the step and the run
    first = _topology(tmp_path, _Fake(fault=("layout-2x2", 1, "a.chunks.1")), layouts="1x1,1x2,2x2").first
    assert first is not None and (first.step, first.kind, first.name, first.run) == (1, "param", "a.chunks.1",
                                                                                   "layout 2x2")
    assert first.sentence("layout 1x1").startswith("layout 2x2 differs from layout 1x1 at step 1: tensor a.chunks.1")
    # a replica that two tp ranks of one run hold with other bits
    first = _topology(tmp_path, _Fake(fault=("layout-1x2", 2, "replica b")), layouts="1x1,1x2").first
    assert first is not None and (first.kind, first.name, first.step) == ("ranks", "param b", 2)
    # losses by global microbatch: microbatch 0 is rank 0's at 2x1, ranks 0 and 1's at 2x2
    result = _topology(tmp_path, _Fake(fault=("layout-2x2", 0, "loss")), layouts="1x1,2x2")
    assert result.first is not None and (result.first.kind, result.first.name, result.first.step) == ("loss", "0", 0)
    assert result.first_param is None  # no parameter differs
    # a loss first, and a parameter later: both named
    result = _topology(tmp_path, _Fake(fault=("layout-1x2", 1, "loss"), param=("layout-1x2", 2, "b")),
                       layouts="1x1,1x2")
    assert result.first is not None and (result.first.kind, result.first.step) == ("loss", 1)
    assert result.first_param is not None and (result.first_param.name, result.first_param.step) == ("b", 2)
    assert result.to_json()["first_param"]["name"] == "b"  # type: ignore[index]


def test_sharded_layouts_compare_losses_and_final_params(tmp_path: Path) -> None:
    # FSDP: each rank records its shard of a parameter under the parameter's name; those are not compared (a fault
    # in one shows nowhere), the losses by global microbatch and the final params lines are
    result = _topology(tmp_path, _Fake(fault=("layout-fsdp2", 1, "b")), layouts="fsdp1,fsdp2,fsdp4")
    assert result.identical and result.steps == 3 and result.tensors == 0
    assert [r.path.name for r in result.runs] == ["layout-fsdp1", "layout-fsdp2", "layout-fsdp4"]
    first = _topology(tmp_path, _Fake(fault=("layout-fsdp4", 2, "loss")), layouts="fsdp1,fsdp4").first
    assert first is not None and (first.kind, first.name, first.step) == ("loss", "0", 2)
    # the final params differ: the first parameter whose `final param` line differs is named
    lines = {"layout-fsdp1": "final param a 00000000000000aa\nfinal param b 00000000000000bb\n",
             "layout-fsdp2": "final param a 00000000000000aa\nfinal param b 00000000000000bc\n"}
    result = _topology(tmp_path, _Fake(final={"layout-fsdp2": "fedcba9876543210"}, lines=lines),
                       layouts="fsdp1,fsdp2")
    assert result.first is not None and result.first.kind == "final params"
    assert result.first_param is not None and (result.first_param.name, result.first_param.step) == ("b", -1)
    # the sentence names the first parameter the sharded run did not record by its global bits
    with pytest.raises(CommandFailed, match="no `final params HEX` line in every run: on layout fsdp2 each rank "
                                            r"holds its own shard of parameter a\.chunks\.0 "):
        _topology(tmp_path, _Fake(final={"layout-fsdp2": "none"}), layouts="fsdp1,fsdp2")
    # one job of sharded and unsharded layouts: the unsharded runs' parameters are still compared step by step
    # against an unsharded reference (one that prints no final params line too: a CMD need not), the sharded
    # run's through its final params line
    mixed = "1x1,fsdp2,1x2"
    result = _topology(tmp_path, _Fake(fault=("layout-fsdp2", 1, "b"), final={"layout-1x2": "none"}), layouts=mixed)
    assert result.identical and result.tensors == 3
    first = _topology(tmp_path, _Fake(fault=("layout-1x2", 1, "b")), layouts=mixed).first
    assert first is not None and (first.kind, first.name, first.step, first.run) == ("param", "b", 1, "layout 1x2")
    first = _topology(tmp_path, _Fake(final={"layout-fsdp2": "fedcba9876543210"}), layouts=mixed).first
    assert first is not None and (first.kind, first.run) == ("final params", "layout fsdp2")
    with pytest.raises(CommandFailed, match="no `final params HEX` line in every run: on layout fsdp2"):
        _topology(tmp_path, _Fake(final={"layout-1x1": "none"}), layouts=mixed)  # the reference's is needed


def test_replicas_on_sharded_layouts_are_compared_after_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # an expert script's router and dense layers: plain tensors that every rank of an fsdp or ep layout holding them
    # records whole, with the unsharded layout's shape, are replicas: compared after every step like 1x1's, so the
    # script needs no final params line (before, they were taken for shards and the run was refused without one)
    runs = ("layout-1x1", "layout-fsdp2", "layout-ep2", "layout-ep2xtp2")
    silent = dict.fromkeys(runs, "none")  # no run prints a final params line
    fake = _Fake(replicas=runs[1:], final=silent)
    result = _topology(tmp_path, fake, layouts="1x1,fsdp2,ep2,ep2xtp2")
    assert result.identical and result.tensors == 3 and result.partial == ()
    # a replica that differs on every rank of one layout: named at the step it first differs
    first = _topology(tmp_path, replace(fake, fault=("layout-ep2", 1, "b")), layouts="1x1,fsdp2,ep2").first
    assert first is not None and (first.kind, first.name, first.step, first.run) == ("param", "b", 1, "layout ep2")
    # one rank's copy (tp rank 1 of ep2xtp2's) with other bits: its ranks disagree
    first = _topology(tmp_path, replace(fake, fault=("layout-ep2xtp2", 2, "replica b")), layouts="1x1,ep2xtp2").first
    assert first is not None and (first.kind, first.name, first.step) == ("ranks", "param b", 2)
    # the verdict counts every parameter (not "of the unsharded layouts")
    _cli_with(monkeypatch, _Fake(replicas=runs[1:]))
    assert cli(["check-topology", "--layouts", "1x1,ep2", "--out", str(tmp_path / "cli"), "--", *CMD]) == 0
    assert capsys.readouterr().out == ("identical: layouts 1x1, ep2 give the same bits (3 steps, 3 parameters, "
                                       "final params 0123456789abcdef)\n")
    # without an unsharded layout nothing tells a replica from a shard of the same shape: the line is needed
    with pytest.raises(CommandFailed, match="no `final params HEX` line in every run: on layout fsdp2"):
        _topology(tmp_path, fake, layouts="fsdp2,ep2")


def test_losses_scaled_by_each_ranks_microbatch_count_are_compared_before_the_scaling(tmp_path: Path) -> None:
    # 1x1 scales each loss by 1/4, 2x2 by 1/2 (torch's averaging over a rank's microbatches): the recorded backward
    # roots differ by a factor of 2 by construction, the losses before the scaling do not
    assert _topology(tmp_path, _Fake(average=True), layouts="1x1,1x2,2x2,2x1").identical
    assert _topology(tmp_path, _Fake(average=True), worlds="1,2,4").identical
    # a real difference in a loss is still found, at its step and microbatch, under either convention
    for average in (True, False):
        first = _topology(tmp_path, _Fake(average=average, fault=("layout-2x2", 1, "loss")), layouts="1x1,2x2").first
        assert first is not None and (first.kind, first.name, first.step) == ("loss", "0", 1), average
    first = _topology(tmp_path, _Fake(average=True, fault=("layout-2x2", 0, "loss")), layouts="1x1,2x2").first
    assert first is not None and (first.kind, first.name, first.step) == ("loss", "0", 0)


def test_layouts_of_other_models_are_refused(tmp_path: Path) -> None:
    # the reference trainer's fsdp layouts train whole weights, its tp layouts chunks: another model, one sentence
    with pytest.raises(IncomparableError, match=r"^layout fsdp1 trains another model than layout 1x1, .*: parameter "
                                                r"a is missing in layout 1x1 and \[4\] in layout fsdp1$"):
        _topology(tmp_path, _Fake(whole=("layout-fsdp1",)), layouts="1x1,fsdp1")
    # a sharded run's parameters are compared by name (each rank records its shard's shape)
    with pytest.raises(IncomparableError, match=r"parameter a is missing in layout 1x1 and sharded in layout fsdp2$"):
        _topology(tmp_path, _Fake(whole=("layout-fsdp2",)), layouts="1x1,fsdp2")


def test_grad_norm_compared_only_without_tensor_parallelism(tmp_path: Path) -> None:
    # the tracer's grad_norm is of a rank's own shards: rank 1 of a tp pair differs from rank 0 (the fake's
    # t * 10 + s), and with T > 1 anywhere it is not compared; with world sizes only, it is
    assert _topology(tmp_path, _Fake(fault=("layout-1x2", 0, "grad_norm")), layouts="1x1,1x2").identical
    first = _topology(tmp_path, _Fake(fault=("world-2", 1, "grad_norm")), worlds="1,2").first
    assert first is not None and (first.kind, first.step, first.run) == ("grad_norm", 1, "world 2")


def test_final_params_and_failing_commands(tmp_path: Path) -> None:
    first = _topology(tmp_path, _Fake(final={"layout-1x2": "fedcba9876543210"}), layouts="1x1,1x2").first
    assert first is not None and first.kind == "final params" and first.step == -1
    with pytest.raises(CommandFailed, match=r"CMD \(layout 1x2\) exited with code 1"):
        _topology(tmp_path, _Fake(fail="layout-1x2"), layouts="1x1,1x2")


def test_elastic_resume_runs_and_comparisons(tmp_path: Path) -> None:
    result = _topology(tmp_path, _Fake(), worlds="2,1,4", resume_at=2)
    assert result.identical, result.first
    assert [r.label for r in result.runs] == ["world 2", "world 2 stopped after step 2",
                                              "world 1 resumed after step 2", "world 4 resumed after step 2"]
    assert [r.path.name for r in result.runs] == ["world-2", "world-2-stopped", "world-1-resumed", "world-4-resumed"]
    # the resumed run is compared from step 2 on; the stopped run's final line (the state at step 2) is not
    assert result.finals["world 2 stopped after step 2"] is None and result.to_json()["resume_at"] == 2
    first = _topology(tmp_path, _Fake(fault=("world-4-resumed", 2, "loss")), worlds="2,1,4", resume_at=2).first
    assert first is not None and (first.run, first.step, first.kind) == ("world 4 resumed after step 2", 2, "loss")
    first = _topology(tmp_path, _Fake(fault=("world-2-stopped", 1, "b")), worlds="2,4", resume_at=2).first
    assert first is not None and (first.run, first.step, first.name) == ("world 2 stopped after step 2", 1, "b")
    # a resumed run that starts at the wrong step misses the reference's step-2 records
    plan = plan_runs((Mesh(dp=2), Mesh(dp=4)), tmp_path, resume_at=2)
    assert plan[2][1] == {"DETRACE_CKPT_DIR": str(tmp_path / "checkpoint"), "DETRACE_RESUME": "1"}
    plan = plan_runs(parse_layouts("fsdp2,2x1"), tmp_path, resume_at=2, tp_env=True)  # layouts resume too
    assert [run.label for run, _ in plan] == ["layout fsdp2", "layout fsdp2 stopped after step 2",
                                             "layout 2x1 resumed after step 2"]
    assert plan[2][1] == {"DETRACE_CKPT_DIR": str(tmp_path / "checkpoint"), "DETRACE_RESUME": "1",
                          "DETRACE_LAYOUT": "2x1", TP_ENV: "1"}
    with pytest.raises(UsageError, match="1 or more"):
        plan_runs((Mesh(dp=1), Mesh(dp=2)), tmp_path, resume_at=0)


def test_layout_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("1x1", "1x1,1x1", "1x3,1x1", "2,4", "1x0,1x1", "ax1,1x1"):
        with pytest.raises(UsageError):
            parse_layouts(bad)
    assert cli(["check-topology", "--worlds", "1,2", "--layouts", "1x1,1x2", "--", "python", "t.py"]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_validation_row_compares_the_dp_invariant_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _topology(tmp_path, _Fake(), worlds="1,2,4")
    row = _topology_row({w: out / f"world-{w}" for w in (1, 2, 4)})
    assert row[0].name == "dp-invariant x1 = x2 = x4" and row[0].nproc == 4
    assert row[1].ok and row[1].text == "identical across world sizes (3 steps)", row[1]
    _topology(tmp_path, _Fake(fault=("world-2", 0, "b")), worlds="1,2")
    row = _topology_row({w: out / f"world-{w}" for w in (1, 2)})
    assert row[1].ok is False and row[1].text.startswith("diverged: world 2 differs from world 1 at step 0")
    row = _topology_row({2: out / "world-1"})  # a run of 1 rank given as world 2: an error in the cell
    assert row[1].ok is False and row[1].text.startswith("error: ")


def _cli_with(monkeypatch: pytest.MonkeyPatch, fake: _Fake) -> None:
    """`detrace check-topology` in process, CMD run by `fake`."""
    import functools

    from detrace.cli import check_topology as command

    monkeypatch.setattr(command, "check_topology", functools.partial(check_topology, launch=fake))


def test_the_command_prints_its_verdict_and_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check-topology", "--worlds", "1,2", "--out"]
    _cli_with(monkeypatch, _Fake())
    assert cli([*argv, str(tmp_path / "same"), "--", *CMD]) == 0
    captured = capsys.readouterr()
    assert captured.out == ("identical: worlds 1, 2 give the same bits (3 steps, 3 parameters, final params "
                            "0123456789abcdef)\n")
    assert f"detrace check-topology: world 2: {tmp_path / 'same' / 'world-2'}" in captured.err
    _cli_with(monkeypatch, _Fake(fault=("world-2", 0, "loss"), param=("world-2", 1, "b")))
    assert cli([*argv, str(tmp_path / "apart"), "--", *CMD]) == 1
    assert capsys.readouterr().out.startswith("diverged: world 2 differs from world 1 at step 0: loss of "
                                              "microbatch 0 (")
    assert cli([*argv, str(tmp_path / "json"), "--json", "--", *CMD]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is False and report["worlds"] == [1, 2]
    assert {k: report["first"][k] for k in ("step", "kind", "world", "run")} == {
        "step": 0, "kind": "loss", "world": 2, "run": "world 2"}
    assert report["first_param"]["name"] == "b" and report["first_param"]["step"] == 1
    # sharded layouts: no parameter is compared per step, the verdict says what was
    _cli_with(monkeypatch, _Fake())
    assert cli(["check-topology", "--layouts", "fsdp1,fsdp2", "--out", str(tmp_path / "fsdp"), "--", *CMD]) == 0
    assert capsys.readouterr().out == ("identical: layouts fsdp1, fsdp2 give the same bits (3 steps, final params "
                                       "0123456789abcdef)\n")
    lines = {"layout-fsdp2": "final param b 00000000000000bc\nfinal param a 00000000000000aa\n",
             "layout-fsdp1": "final param b 00000000000000bb\nfinal param a 00000000000000aa\n"}
    _cli_with(monkeypatch, _Fake(final={"layout-fsdp2": "fedcba9876543210"}, lines=lines))
    assert cli(["check-topology", "--layouts", "fsdp1,fsdp2", "--out", str(tmp_path / "fsdp-apart"), "--", *CMD]) == 1
    assert capsys.readouterr().out.rstrip().endswith("; the first parameter that differs: b at the end")


def test_each_run_gets_its_own_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """One check of several layouts says which keep the bits and which do not (and where each first differs), so
    one job can hold an invariant layout and plain controls: the headline is the first run that differs."""
    fake = _Fake(fault=("layout-1x2", 1, "loss"), param=("layout-1x2", 2, "b"),
                 final={"layout-2x1": "fedcba9876543210"})
    result = _topology(tmp_path, fake, layouts="1x1,1x2,2x2,2x1")
    assert [v.run for v in result.verdicts] == ["layout 1x2", "layout 2x2", "layout 2x1"]
    apart, same, last = result.verdicts
    assert apart.first is not None and (apart.first.kind, apart.first.step) == ("loss", 1)
    assert apart.first_param is not None and (apart.first_param.name, apart.first_param.step) == ("b", 2)
    assert same.first is None and same.first_param is None
    assert last.first is not None and (last.first.kind, last.first.run) == ("final params", "layout 2x1")
    assert (result.first, result.first_param) == (apart.first, apart.first_param)
    by_run = result.to_json()["by_run"]
    assert by_run["layout 2x2"] == {"identical": True, "first": None, "first_param": None}  # type: ignore[index]
    assert by_run["layout 2x1"]["first"]["kind"] == "final params"  # type: ignore[index]
    # a stopped run ends after step K: its last line is not compared with the end's
    result = _topology(tmp_path, _Fake(final={"layout-2x2-resumed": "fedcba9876543210"}), layouts="1x1,2x2,1x2",
                       resume_at=1)
    assert [(v.run, v.first is None) for v in result.verdicts] == [
        ("layout 1x1 stopped after step 1", True), ("layout 2x2 resumed after step 1", False),
        ("layout 1x2 resumed after step 1", True)]
    _cli_with(monkeypatch, fake)
    assert cli(["check-topology", "--layouts", "1x1,1x2,2x2,2x1", "--out", str(tmp_path / "cli"), "--", *CMD]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("diverged: layout 1x2 differs from layout 1x1 at step 1: loss of microbatch ")
    assert out[1:] == [out[0].replace("diverged: layout 1x2 differs from layout 1x1", "  layout 1x2: diverged"),
                       "  layout 2x2: identical",
                       "  layout 2x1: diverged at the final params line (0123456789abcdef vs fedcba9876543210)"]


def test_a_failing_command_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _cli_with(monkeypatch, _Fake(fail="world-1"))
    assert cli(["check-topology", "--worlds", "1,2", "--out", str(tmp_path / "fail"), "--", *CMD]) == 2
    err = capsys.readouterr().err
    # one sentence of ours, then the end of CMD's output
    assert "detrace check-topology: error: CMD (world 1) exited with code 1; its output ends with:\nstep 3" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------
# real runs: one per question, tiny preset


TRAIN = [sys.executable, "-m", "detrace.workload.train", "--microbatches", "4", "--dispatch", "fixed",
         "--deterministic", "--threads", "1"]


def _check_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, *args: str
               ) -> tuple[int, dict[str, object]]:
    """`detrace check-topology --json ARGS`, in this process (CMD's runs are real torchrun jobs): exit code, report."""
    code = cli(["check-topology", "--json", "--out", str(tmp_path / name), "--timeout", "300", *args])
    captured = capsys.readouterr()
    assert captured.out.strip(), captured.err
    return code, json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.slow
def test_tp_invariant_layers_give_the_same_bits_on_dp_fsdp_and_pipeline_meshes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one job, the composed meshes of tensor parallelism in turn: the 2x2 mesh (D x T) runs on, and stops after step
    # 1; one process (1x1: T and D changed at once; T = 2 alone, 1x2, is one run more for no other question) and the
    # other meshes resume from its checkpoint (each tp rank saved its chunks by global index, DCP reshards): fsdp2xtp2
    # shards each rank's projection chunks; pp2xtp2 runs them in 2 stages under GPipe (1F1B: the pipeline test), each
    # loading its layers; ep2xtp2 splits the experts over ep and runs the chunks over tp. Every parameter by global
    # name after every step (the shards of fsdp2xtp2 and ep2xtp2: in their final params lines), each resumed run
    # against the run that never stopped
    code, report = _check_cli(capsys, tmp_path, "tp", "--layouts", "2x2,1x1,fsdp2xtp2,pp2xtp2,ep2xtp2",
                              "--resume-at", "1", "--", *TRAIN, "--parallel", "invariant", "--schedule", "gpipe",
                              "--steps", "2")
    assert code == 0, report
    assert list(report["runs"]) == ["layout 2x2", "layout 2x2 stopped after step 1",  # type: ignore[call-overload]
                                    *(f"layout {name} resumed after step 1"
                                      for name in ("1x1", "fsdp2xtp2", "pp2xtp2", "ep2xtp2"))]
    finals = report["final_params"]  # pp2xtp2's too: each stage's entries, a chunk's from its tp rank
    assert isinstance(finals, dict) and finals.pop("layout 2x2 stopped after step 1") != finals["layout 2x2"]
    assert len(set(finals.values())) == 1 and None not in finals.values()
    assert report["steps"] == 2 and report["tensors"] > 31  # the projections as chunks, by global name


@pytest.mark.slow
def test_the_reference_workload_with_moe_gives_the_same_bits_at_worlds_1_2_4_and_across_an_elastic_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # world 4 (and the resume onto 4 ranks) is the fsdp test's: fsdp4 resumed from a 2x2 mesh
    code, report = _check_cli(capsys, tmp_path, "elastic", "--worlds", "2,1", "--resume-at", "1", "--", *TRAIN,
                              "--parallel", "dp-invariant", "--steps", "2")
    assert code == 0, report
    assert list(report["runs"]) == ["world 2", "world 2 stopped after step 1",  # type: ignore[call-overload]
                                    "world 1 resumed after step 1"]
    from detrace.workload.model import PRESETS, HybridLM

    model = HybridLM(PRESETS["tiny"]["model"])  # type: ignore[arg-type]
    assert report["steps"] == 2 and report["tensors"] == len(list(model.parameters()))
    # worlds 1, 2 and 4 end with the same parameters; the stopped run's line (the state after step 1) is not the end's
    finals = report["final_params"]
    assert isinstance(finals, dict) and finals.pop("world 2 stopped after step 1") != finals["world 2"]
    assert len(set(finals.values())) == 1 and re.fullmatch(r"[0-9a-f]{16}", str(finals["world 1 resumed after step 1"]))


def _seeded(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.get_rng_state()


def test_a_world_size_beyond_the_machine_needs_force(capsys: pytest.CaptureFixture[str]) -> None:
    too_many = 4 * (os.cpu_count() or 1) + 1
    with pytest.raises(UsageError, match="pass --force to start them"):
        parse_worlds(f"{too_many},2")
    assert parse_worlds(f"{too_many},2", force=True) == (too_many, 2)
    assert cli(["check-topology", "--worlds", f"{too_many},2", "--", "true"]) == 2  # before torchrun starts
    assert "pass --force" in capsys.readouterr().err
    # --layouts by the same bound: 64x64 is 4096 processes, 1x1,4x4 on one core 16
    big = 1 << too_many.bit_length()  # a power of two above the bound
    for layouts, processes in (("64x64,1x1", 4096), (f"1x1,{big}x1", big)):
        with pytest.raises(UsageError, match=f"--layouts {layouts} would start {processes} processes"):
            parse_layouts(layouts)
        assert cli(["check-topology", "--layouts", layouts, "--", "true"]) == 2
        assert "pass --force" in capsys.readouterr().err
    assert parse_layouts(f"1x1,{big}x1", force=True)[1].world == big
    # an empty --worlds or --layouts is refused, not read as the default 1,2,4
    for option, words in (("--worlds", "--worlds must be comma-separated"), ("--layouts", "not ''")):
        assert cli(["check-topology", option, "", "--", "true"]) == 2
        assert words in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_1_2_4_and_fsdp2xep2_give_the_same_bits_across_a_resume_from_a_2x2_mesh_and_fully_shard_does_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the 2x2 mesh dp2xfsdp2 (2 replicas of 2 shards) runs on, and stops after step 1; fsdp4, fsdp2, one process and
    # the 2x2 mesh fsdp2xep2 (experts over 2 ranks, their replicas over 2, data over all 4, the other parameters
    # sharded over all 4) resume from its checkpoint (DCP reshards): each equals the run that never stopped, step by
    # step (losses by global microbatch) and in the final parameters. (ep2xdp2 is fsdp2xep2 with the other
    # parameters whole: its tree over unsharded gradients is ep2xtp2's, in the tp test; a 4-rank run costs ~20 s)
    code, report = _check_cli(capsys, tmp_path, "fsdp", "--layouts", "dp2xfsdp2,fsdp4,fsdp2,dp1,fsdp2xep2",
                              "--resume-at", "1", "--", *TRAIN, "--parallel", "invariant", "--steps", "2")
    assert code == 0, report
    assert list(report["runs"]) == ["layout dp2xfsdp2",  # type: ignore[call-overload]
                                    "layout dp2xfsdp2 stopped after step 1", "layout fsdp4 resumed after step 1",
                                    "layout fsdp2 resumed after step 1", "layout dp1 resumed after step 1",
                                    "layout fsdp2xep2 resumed after step 1"]
    finals = report["final_params"]
    assert isinstance(finals, dict) and finals.pop("layout dp2xfsdp2 stopped after step 1") != \
        finals["layout dp2xfsdp2"]
    assert len(set(finals.values())) == 1 and None not in finals.values()
    # the control: fully_shard's own gradient accumulation and reduce-scatter (2 shards, 4 of 8 microbatches each)
    # sums in another order than one process does; check-topology names the first parameter that differs, at the
    # step (each rank records its shards' parts of the global fingerprints, which it adds up) (the ordinary
    # all-to-all MoE's control is in process: tests/unit/test_expert_parallel.py; a job costs ~5 s a rank)
    code, report = _check_cli(capsys, tmp_path, "plain", "--layouts", "fsdp1,fsdp2", "--", *TRAIN, "--parallel",
                              "plain", "--microbatches", "8", "--steps", "1")
    first = report["first"]
    assert code == 1 and isinstance(first, dict) and (first["kind"], first["step"]) == ("param", 0), report
    assert first["name"] in {n for n, _ in _tiny().named_parameters()}


def _tiny() -> nn.Module:
    from detrace.workload.model import PRESETS, HybridLM

    return HybridLM(PRESETS["tiny"]["model"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_pipeline_invariant_gives_the_bits_of_one_process_under_1f1b_times_dp_and_autograds_running_sum_does_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 1F1B on the composed meshes against one process: pp2xdp2 (2 stages, each data-parallel over 2) with every
    # parameter by name after every step (each stage holds its own, its dp replicas agree); pp2xfsdp2 (each stage
    # sharded over 2, the tree in its reduce-scatter) and pp2xep2 (each stage's experts split over 2 ranks that split
    # its data too; 1F1B runs a second forward before the first backward, which the experts' leaves wait for)
    # through their final params (shards); all with the losses by global microbatch at every step (GPipe: pp2xtp2 in
    # the tp test; pp2xep2 under GPipe: by hand, docs/topology.md)
    code, report = _check_cli(capsys, tmp_path, "1f1b", "--layouts", "fsdp1,pp2xdp2,pp2xfsdp2,pp2xep2", "--", *TRAIN,
                              "--parallel", "invariant", "--schedule", "1f1b", "--steps", "2")
    assert code == 0, report
    assert report["steps"] == 2 and report["tensors"] == len(list(_tiny().parameters()))
    finals = report["final_params"]  # the pipelines' stages each give their own parameters' entries
    assert isinstance(finals, dict) and len(set(finals.values())) == 1 and None not in finals.values()
    # the control: the same schedule, seeds and loss, each stage's microbatch gradients summed in autograd's running
    # sum (in the order the backwards run) instead of the tree: another parameter after the first step, named
    code, report = _check_cli(capsys, tmp_path, "plain", "--layouts", "pp1,pp2", "--", *TRAIN, "--parallel", "plain",
                              "--steps", "1")
    first = report["first"]
    assert code == 1 and isinstance(first, dict), report
    assert (first["kind"], first["step"], first["run"]) == ("param", 0, "layout pp2")
    assert first["name"] in {n for n, _ in _tiny().named_parameters()}


def test_a_loss_that_differs_is_shown_as_a_decimal_beside_its_bits(tmp_path: Path) -> None:
    """#46.6: two losses were shown as their bits alone (0x3fe5... vs 0x3fe5...): the size of the difference did not
    show. Each is its decimal (the shortest that reads back as the same double), then its bits."""
    first = _topology(tmp_path, _Fake(fault=("layout-2x2", 0, "loss")), layouts="1x1,2x2").first
    assert first is not None and first.kind == "loss"
    shown = re.fullmatch(r"(\S+) \((0x[0-9a-f]{16})\) vs (\S+) \((0x[0-9a-f]{16})\)", first.detail)
    assert shown is not None, first.detail
    for decimal, bits in (shown.group(1, 2), shown.group(3, 4)):
        assert struct.pack(">d", float(decimal)).hex() == bits[2:]
    assert shown[1] != shown[3]
    params = _topology(tmp_path, _Fake(fault=("layout-1x2", 1, "b")), layouts="1x1,1x2").first
    assert params is not None and params.kind == "param" and "(" not in params.detail  # digests as they are


def _pipeline_ends(*, stale: bool) -> Launch:
    """A launch that writes a 2-parameter model's traces: at pp2 each stage steps one parameter and records it as the
    run ends; `stale`: each also records the other stage's parameter, which it never trained (other bits per rank)."""
    def launch(argv: list[str], run: Path, env: dict[str, str], timeout: float | None) -> LaunchResult:
        stages = Layout.parse(env[LAYOUT_ENV]).size("pp")
        names = ("w0", "w1")
        for rank in range(stages):
            mine = names if stages == 1 else names[rank:rank + 1]
            final = {name: 10 + i for i, name in enumerate(names) if name in mine or stale}
            if stale and stages > 1:
                final = {name: digest + (name not in mine) * (rank + 1) for name, digest in final.items()}
            steps = [TrainingStep(step=0, params={name: 1 for name in mine}, final=final)]
            write_training_rank(run, rank, steps, world_size=stages)
        return LaunchResult(returncode=0, out=run, command=tuple(argv), elapsed=0.1, output_tail="")
    return launch


def test_a_disagreement_of_ranks_at_the_end_reads_at_the_end(tmp_path: Path) -> None:
    """#46/#47: a pipeline rank that recorded, as the run ended, a parameter it never stepped made its ranks disagree
    "at step 9223372036854775806" (the final phase's internal step). The ranks' own final parameters are compared
    like any; a disagreement among them is placed at the end."""
    meshes = parse_layouts("pp1,pp2")
    result = check_topology(CMD, meshes=meshes, out=tmp_path / "a", tp_env=True,
                            launch=_pipeline_ends(stale=False))
    assert result.identical, result.first
    result = check_topology(CMD, meshes=meshes, out=tmp_path / "b", tp_env=True,
                            launch=_pipeline_ends(stale=True))
    first = result.first
    assert first is not None and (first.kind, first.name, first.step) == ("ranks", "final w0", -1)
    assert first.sentence("layout pp1") == ("layout pp2's ranks disagree at the end: final w0 "
                                            "(rank 0 000000000000000a, rank 1 000000000000000c)")
    assert str(2**63 - 2) not in first.sentence("layout pp1")
