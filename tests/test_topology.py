"""Same bits at any data-parallel world size: detrace.parallel's fixed-tree reduction, the trainer's
--parallel dp-invariant, and `detrace check-topology`."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from detrace.cli import main as cli
from detrace.errors import UsageError
from detrace.examples.validate import _topology_row
from detrace.parallel import InvariantDataParallel, _tree_plan, invariant_backward, owned_microbatches
from detrace.topology import parse_worlds, torchrun_command
from tests._ranks import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
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
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_world_sizes_1_2_4_and_both_exchanges_give_the_same_bits(tmp_path: Path) -> None:
    loss, grads = _step(_model())
    spawn_ranks(_ranks, (str(tmp_path),), nprocs=4, timeout=240)
    for rank in range(4):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert "rank 1 of the data-parallel group holds other parameters" in saved["refused"]
        assert sorted(saved["results"]) == ["2-doubling", "2-gather", "4-doubling", "4-gather"]
        for key, (got_loss, *got_grads) in saved["results"].items():
            assert torch.equal(got_loss, loss), key
            assert all(torch.equal(a, b) for a, b in zip(got_grads, grads, strict=True)), key


def _train_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str, **env: str) -> list[str]:
    from detrace.examples.train import main

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
    from detrace.examples.train import main

    assert main(["--parallel", "dp-invariant", "--dispatch", "fixed"]) == 2  # no --microbatches
    assert main(["--microbatches", "2"]) == 2  # without dp-invariant
    assert main(["--parallel", "dp-invariant", "--microbatches", "2"]) == 2  # the racing index dispatch
    # 3 microbatches do not divide the batch of 8
    assert main(["--parallel", "dp-invariant", "--microbatches", "3", "--dispatch", "fixed"]) == 2


def _check_topology(tmp_path: Path, name: str, worlds: str, *cmd: str) -> tuple[int, dict[str, object]]:
    proc = subprocess.run([sys.executable, "-m", "detrace", "check-topology", "--json", "--worlds", worlds,
                           "--out", str(tmp_path / name), "--timeout", "300", "--", *cmd],
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_check_topology_passes_the_reference_workload_with_moe(tmp_path: Path) -> None:
    code, report = _check_topology(tmp_path, "tiny", "1,2,4", sys.executable, "-m", "detrace.examples.train",
                                   "--parallel", "dp-invariant", "--microbatches", "4", "--dispatch", "fixed",
                                   "--deterministic", "--steps", "2", "--threads", "1")
    assert code == 0, report
    from detrace.examples.model import PRESETS, HybridLM

    model = HybridLM(PRESETS["tiny"]["model"])  # type: ignore[arg-type]
    assert report["steps"] == 2 and report["tensors"] == len(list(model.parameters()))
    finals = report["final_params"]
    assert isinstance(finals, dict) and len(set(finals.values())) == 1
    assert re.fullmatch(r"[0-9a-f]{16}", str(finals["1"]))
    # the validation matrix's row comparing its dp-invariant runs, on these runs
    row = _topology_row({w: tmp_path / "tiny" / f"world-{w}" for w in (1, 2, 4)})
    assert row[0].name == "dp-invariant x1 = x2 = x4" and row[1].ok, row[1]


@pytest.mark.slow
def test_check_topology_on_a_plain_loop_and_its_naive_fault(tmp_path: Path) -> None:
    code, report = _check_topology(tmp_path, "plain", "1,2", sys.executable, str(LOOP), "--steps", "2")
    assert code == 0, report
    # Test-only fault: the same loop reducing the usual way (running-order accumulation, then all_reduce)
    code, report = _check_topology(tmp_path, "naive", "1,2", sys.executable, str(LOOP), "--steps", "2",
                                   "--reduce", "naive")
    assert code == 1, report
    first = report["first"]
    assert isinstance(first, dict) and first["step"] == 0 and first["world"] == 2
    assert first["kind"] in ("loss", "grad_norm", "param")
    row = _topology_row({1: tmp_path / "plain" / "world-1", 2: tmp_path / "naive" / "world-2"})
    assert row[1].ok is False and row[1].text.startswith("diverged: world 2 differs from world 1 at step 0")


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
    from detrace.errors import CommandFailed, TraceError
    from detrace.topology import compare_runs

    with detrace.trace(tmp_path / "run", rung="semantic"):
        (torch.ones(3, requires_grad=True) * 2).sum().backward()  # a loss, but no optimizer step
    with pytest.raises(CommandFailed, match="no parameters"):
        compare_runs({1: tmp_path / "run"})
    with pytest.raises(TraceError, match="not of all 2 ranks"):
        compare_runs({2: tmp_path / "run"})


@pytest.mark.slow
def test_check_topology_reports_a_failing_command(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "detrace", "check-topology", "--worlds", "1,2", "--out",
                           str(tmp_path / "fail"), "--", sys.executable, "-c", "raise SystemExit(3)"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    # one sentence of ours, then the end of CMD's output (torchrun's own report of the failed worker)
    assert "detrace check-topology: error: CMD at world size 1 exited with code 1" in proc.stderr


def test_a_world_size_beyond_the_machine_needs_force(capsys: pytest.CaptureFixture[str]) -> None:
    too_many = 4 * (os.cpu_count() or 1) + 1
    with pytest.raises(UsageError, match="pass --force to start them"):
        parse_worlds(f"{too_many},2")
    assert parse_worlds(f"{too_many},2", force=True) == (too_many, 2)
    assert cli(["check-topology", "--worlds", f"{too_many},2", "--", "true"]) == 2  # before torchrun starts
    assert "pass --force" in capsys.readouterr().err
