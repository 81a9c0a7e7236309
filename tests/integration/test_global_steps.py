"""Global steps: the tracer numbers steps from the training's start across restarts, from the source that applies
(TrainState, an explicit call or DETRACE_STEP_OFFSET, an integration, a restored optimizer), records the input
batch, and `detrace diff` compares two runs on the global steps both have."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import detrace
from detrace.cli import main
from detrace.errors import UsageError
from detrace.launch.launcher import run_traced
from detrace.record import set_step
from detrace.record.steps import STEP_OFFSET_ENV, StepClock
from detrace.tracefile import read_rank
from detrace.tracefile.layout import run_header_path
from detrace.tracefile.metadata import StepAccount
from detrace.tracefile.writer import write_json_atomic


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(x)) * scale)


def _batches(n: int, *, shift: int | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, generator=gen) for _ in range(n)]
    if shift is not None:
        batches[shift] = batches[shift] + 1  # the data of one step differs
    return batches


def _train(model: Model, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], steps: range) -> None:
    for i in steps:
        loss = nn.functional.mse_loss(model(batches[i], scale=torch.tensor(2.0)), torch.zeros(8, 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _fresh() -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _footer(run: Path) -> StepAccount | None:
    footer = read_rank(run, 0).footer
    assert footer is not None
    return footer.steps


def _steps(run: Path) -> list[int]:
    return sorted(set(read_rank(run, 0).table.column("step").to_pylist()))


def _continuous_and_resumed(tmp_path: Path, *, restore: str = "load_state_dict", shift: int | None = None,
                            rung: str = "semantic") -> tuple[Path, Path]:
    """Run A: 6 steps traced. Run B: 3 steps untraced, then a fresh model and optimizer restored from them and
    traced for steps 3-5, with no step number given anywhere."""
    a, b = tmp_path / "a", tmp_path / "b"
    with detrace.trace(a, rung=rung):
        model, optimizer = _fresh()
        _train(model, optimizer, _batches(6), range(6))
    model, optimizer = _fresh()
    _train(model, optimizer, _batches(6), range(3))
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    with detrace.trace(b, rung=rung):
        model, optimizer = _fresh()
        model.load_state_dict(saved_model)
        if restore == "load_state_dict":
            optimizer.load_state_dict(saved_optimizer)
        else:  # state put in place without load_state_dict: read as the first optimizer step begins
            for p, state in zip(model.parameters(), saved_optimizer["state"].values(), strict=True):
                optimizer.state[p] = {k: v.clone() for k, v in state.items()}
        _train(model, optimizer, _batches(6, shift=shift), range(3, 6))
    return a, b


@pytest.mark.parametrize("restore", ["load_state_dict", "first_step"])
def test_a_restored_optimizer_gives_the_global_step_with_no_edit(tmp_path: Path, restore: str) -> None:
    a, b = _continuous_and_resumed(tmp_path, restore=restore)
    assert _steps(a) == [0, 1, 2, 3, 4, 5] and _steps(b) == [3, 4, 5]
    assert _footer(a) == StepAccount(first=0, recorded=(0, 5), source="process")
    assert _footer(b) == StepAccount(first=3, recorded=(3, 5), source="optimizer")
    result = detrace.diff(a, b)
    assert result.verdict == "identical" and result.compared.steps == (3, 5)
    assert result.steps == "compared global steps 3-5 (B resumed after step 3)"


def test_diff_names_the_input_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _continuous_and_resumed(tmp_path, shift=4)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "compared global steps 3-5 (B resumed after step 3)" in out
    assert "first divergence: rank 0, step 4, the input batch (input[0], call #0) [numeric]" in out
    assert "the input batch differs" in out and "not an origin" not in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first"]["phase"] == "data" and report["first"]["name"] == "batch"
    assert report["compared"]["steps"] == {"first": 3, "last": 5}


def test_the_batch_is_the_outermost_models_tensors_per_call(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "t", rung="semantic"):
        model, optimizer = _fresh()
        loss_fn = nn.MSELoss()  # outermost too, but no parameters: not a batch
        for _ in range(2):  # two microbatches
            loss_fn(model(torch.ones(2, 4), scale=torch.tensor(3.0)), torch.zeros(2, 1)).backward()
        optimizer.step()
    batch = [r for r in read_rank(tmp_path / "t", 0).table.to_pylist() if r["phase"] == "data"]
    assert [(r["name"], r["occurrence"], r["index"], r["shape"]) for r in batch] == [
        ("batch", 0, 0, [2, 4]), ("batch", 0, 1, []), ("batch", 1, 0, [2, 4]), ("batch", 1, 1, [])]
    assert json.loads(batch[0]["extra"]) == {"module": "Model", "args": ["0", "scale"]}
    assert all(r["rung"] == "semantic" and r["role"] == "input" and r["step"] == 0 for r in batch)


def test_sources_follow_their_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, saved = _fresh()
    model, optimizer = _fresh()
    _train(model, optimizer, _batches(2), range(2))
    saved = optimizer.state_dict()
    monkeypatch.setenv("DETRACE_STEP_OFFSET", "7")
    with detrace.trace(tmp_path / "env", rung="metrics"):
        model, optimizer = _fresh()
        optimizer.load_state_dict(saved)  # step 2 in the state: below the offset's precedence
        _train(model, optimizer, _batches(2), range(1))
    assert _footer(tmp_path / "env") == StepAccount(first=7, recorded=(7, 7), source="env")
    monkeypatch.delenv("DETRACE_STEP_OFFSET")
    with detrace.trace(tmp_path / "hf", rung="metrics"):
        set_step(5, source="hf")
        detrace.step(9)  # explicit beats an integration
        set_step(1, source="hf")  # ignored from now on
        model, optimizer = _fresh()
        _train(model, optimizer, _batches(2), range(2))
        set_step(12, source="train_state")  # TrainState beats everything
        _train(model, optimizer, _batches(2), range(1))
    assert _steps(tmp_path / "hf") == [9, 10, 12]
    assert _footer(tmp_path / "hf") == StepAccount(first=9, recorded=(9, 12), source="train_state")


def test_train_state_gives_the_step_and_its_restore_stays_out_of_the_steps(tmp_path: Path) -> None:
    model, optimizer = _fresh()
    _train(model, optimizer, _batches(3), range(3))
    state = detrace.TrainState(model=model, optimizer=optimizer)
    state.step = 3
    state.save(tmp_path / "ckpt")
    with detrace.trace(tmp_path / "t", rung="semantic"):
        model, optimizer = _fresh()
        tracer = detrace.record.active()
        assert detrace.TrainState(model=model, optimizer=optimizer).load(tmp_path / "ckpt") == 3
        assert tracer.clock.detecting  # turned off only while TrainState restored
        _train(model, optimizer, _batches(5), range(3, 5))
    assert _footer(tmp_path / "t") == StepAccount(first=3, recorded=(3, 4), source="train_state")


def test_the_step_clock_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """StepClock without a tracer: a restored count believed only before the first step ends, occurrences counted
    afresh in each step, trailing work kept in its step, a second optimizer right after the first in the same
    step, sources by precedence."""
    monkeypatch.delenv(STEP_OFFSET_ENV, raising=False)
    moves: list[int] = []
    clock = StepClock(lock=threading.RLock(), moved=lambda: moves.append(clock.step))
    assert (clock.step, clock.source, clock.stepped) == (0, "process", False)
    assert [clock.begin("op", "forward", "mm").occurrence for _ in range(2)] == [0, 1]
    assert clock.restored(4) and (clock.step, clock.source) == (4, "optimizer")
    assert clock.begin("op", "forward", "mm").occurrence == 0
    first, second = object(), object()
    clock.optimizer_begins(first)
    clock.optimizer_ends()
    assert clock.stepped and clock.trailing and not clock.restored(9)
    assert clock.step == 4 and clock.begin("metrics", "forward", "loss").occurrence == 0  # trailing: still step 4
    clock.optimizer_begins(second)
    clock.optimizer_ends()
    assert clock.step == 4 and clock.begin("op", "forward", "mm").occurrence == 1
    clock.work_begins()
    assert clock.step == 5 and not clock.trailing
    clock.optimizer_begins(first)
    clock.optimizer_ends()
    clock.optimizer_begins(first)  # the same optimizer again, with no backward seen: the next step
    assert clock.step == 6
    clock.optimizer_ends()
    assert clock.set_step(9, "hf") and clock.step == 6  # said after the step: the number of the next one
    clock.work_begins()
    assert clock.step == 9
    assert clock.set_step(7, "hf") and not clock.set_step(2, "optimizer") and clock.set_step(3, "explicit")
    assert not clock.set_step(8, "lightning")
    assert moves == [4, 5, 6, 9, 7, 3]
    assert clock.steps([4, 5]) == {"first": 4, "recorded": [4, 5], "source": "explicit"}


def _traced_and_resumed_after_step_2(tmp_path: Path,
                            train: Callable[[Model, torch.optim.Optimizer, range], None]) -> None:
    """`train` over steps 0-3 traced into a, and into b the same run resumed after step 2 from a TrainState."""
    with detrace.trace(tmp_path / "a", rung="semantic"):
        train(*_fresh(), range(4))
    model, optimizer = _fresh()
    train(model, optimizer, range(2))
    state = detrace.TrainState(model=model, optimizer=optimizer)
    state.step = 2
    state.save(tmp_path / "ckpt")
    with detrace.trace(tmp_path / "b", rung="semantic"):
        model, optimizer = _fresh()
        detrace.TrainState(model=model, optimizer=optimizer).load(tmp_path / "ckpt")
        train(model, optimizer, range(2, 4))


def test_work_after_the_optimizer_step_belongs_to_that_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A loop that logs its loss after `optimizer.step()`: the record lands in the step that computed it, so a run
    resumed from a TrainState after step 2 matches the continuous run from step 2 on (it never ran step 1's
    trailing work)."""

    def train(model: Model, optimizer: torch.optim.Optimizer, steps: range) -> None:
        batches = _batches(4)
        for i in steps:
            loss = nn.functional.mse_loss(model(batches[i], scale=torch.tensor(2.0)), torch.zeros(8, 1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            detrace.metric("logged", loss)

    _traced_and_resumed_after_step_2(tmp_path, train)
    logged = [(r["step"], r["occurrence"]) for r in read_rank(tmp_path / "a", 0).table.to_pylist()
              if r["name"] == "logged"]
    assert logged == [(0, 0), (1, 0), (2, 0), (3, 0)]
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0, capsys.readouterr().out


def test_a_step_given_as_a_closure_records_its_own_gradients(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's loop: each step's zero_grad, forward and backward run in a closure passed to `optimizer.step`. The
    gradients recorded are the step's own (not the previous step's, still there as the step hooks begin), so a
    run resumed from a TrainState after step 2, whose optimizer has no gradients yet, matches the continuous run
    from step 2 on."""

    def train(model: Model, optimizer: torch.optim.Optimizer, steps: range, norms: list[float]) -> None:
        batches = _batches(4)
        for i in steps:
            def closure(batch: torch.Tensor = batches[i]) -> torch.Tensor:
                loss = nn.functional.mse_loss(model(batch, scale=torch.tensor(2.0)), torch.zeros(8, 1))
                optimizer.zero_grad()
                loss.backward()
                norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
                return loss

            optimizer.step(closure=closure) if i % 2 else optimizer.step(closure)  # by keyword and by position

    norms: list[float] = []  # the continuous run's, steps 0-3
    _traced_and_resumed_after_step_2(tmp_path, lambda model, optimizer, steps: train(
        model, optimizer, steps, norms if steps == range(4) else []))
    recorded = [(r["step"], r["value"]) for r in read_rank(tmp_path / "a", 0).table.to_pylist()
                if r["name"] == "grad_norm"]
    assert [step for step, _ in recorded] == [0, 1, 2, 3]
    assert [value for _, value in recorded] == pytest.approx(norms, rel=1e-6)
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "ten", "1.5"])
def test_a_malformed_step_offset_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DETRACE_STEP_OFFSET", value)
    with pytest.raises(UsageError, match="DETRACE_STEP_OFFSET must be a non-negative integer"), \
            detrace.trace(tmp_path / "t"):
        pass


def test_set_step_needs_a_step_and_a_source() -> None:
    with pytest.raises(UsageError, match="non-negative integer"):
        set_step(-3)
    with pytest.raises(UsageError, match="source name"):
        set_step(3, source="")
    with pytest.raises(UsageError, match="non-negative integer"):
        detrace.step(True)  # type: ignore[arg-type]


def test_runs_with_no_common_step_are_incomparable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, start in (("a", 0), ("b", 5)):
        with detrace.trace(tmp_path / name, rung="metrics"):
            detrace.step(start)
            model, optimizer = _fresh()
            _train(model, optimizer, _batches(2), range(2))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "no global step in common" in err and "global steps 0-1" in err and "global steps 5-6" in err


def test_diff_says_when_the_commands_differ(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for name, x in (("a", 1), ("b", 2)):
        runs[name] = str(tmp_path / name)
        script = f"import torch, detrace as d; d.metric('x', {x}); d.step()"
        with detrace.trace(runs[name]):  # what `detrace run -- python -c SCRIPT` records, in this process
            detrace.metric("x", x)
            detrace.step()
        header = json.loads(run_header_path(runs[name]).read_text())
        header["command"] = [sys.executable, "-c", script]  # the command as the launcher's run.json gives it
        write_json_atomic(run_header_path(runs[name]), header)
    assert main(["diff", runs["a"], runs["b"]]) == 1
    out = capsys.readouterr().out
    assert "the runs are of different commands: A ran `... -c 'import torch, detrace as d;" in out
    assert "and B ran `... -c 'import torch, detrace as d;" in out
    assert main(["diff", runs["a"], runs["b"], "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["notes"][0].startswith("the runs are of different commands")
    assert main(["diff", runs["a"], runs["b"], "--strict-command"]) == 2
    assert "incomparable" not in capsys.readouterr().out


def test_certify_expects_a_resumed_run_from_its_first_global_step(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_STEP_OFFSET", "4")
    with detrace.trace(tmp_path / "resumed", rung="metrics"):
        model, optimizer = _fresh()
        _train(model, optimizer, _batches(3), range(3))
    assert _steps(tmp_path / "resumed") == [4, 5, 6]
    assert main(["certify", str(tmp_path / "resumed")]) == 0  # steps 0-3 ran in another process
    assert main(["certify", str(tmp_path / "resumed"), "--expected-steps", "0-6"]) == 1  # asked for: missing


RESUMED_LOOP = """
import torch
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_run_json_keeps_the_global_steps_the_run_covered(tmp_path: Path) -> None:
    result = run_traced([sys.executable, "-c", RESUMED_LOOP], tmp_path / "run", rung="metrics", quiet=True,
                        env={"DETRACE_STEP_OFFSET": "4"})
    assert result.returncode == 0, result.output_tail
    header = json.loads((tmp_path / "run" / "run.json").read_text())
    assert header["status"] == "finished" and header["steps"] == {"first": 4, "last": 6}
