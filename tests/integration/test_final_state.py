"""The final state: as its trace closes, the tracer records each parameter of the models the optimizers trained (by
qualified name) and one digest per model, in phase "final"; the diff compares it after the last step, and a run
that stops early, or trains nothing, is never the same run as one that ran on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import detrace
from detrace.cli import main
from detrace.record import set_step
from detrace.tracefile import read_rank


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(x)))


def _fresh() -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: Model, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _run(out: Path, steps: range = range(4), *, after: float = 0.0) -> None:
    with detrace.trace(out, rung="semantic"):
        model, optimizer = _fresh()
        _train(model, optimizer, steps)
        if after:
            with torch.no_grad():
                model.inner.weight.add_(after)  # what a final averaging or quantisation done wrong does


def _final(run: Path) -> list[dict]:
    table = read_rank(run, 0).table
    return [row for row in table.to_pylist() if row["phase"] == "final"]


def test_the_final_state_is_one_record_per_parameter_then_the_models_digest(tmp_path: Path) -> None:
    _run(tmp_path / "a")
    final = _final(tmp_path / "a")
    assert [(r["name"], r["role"]) for r in final] == [
        ("inner.weight", "param"), ("inner.bias", "param"), ("head.weight", "param"), ("head.bias", "param"),
        ("Model", "model")]
    assert {r["step"] for r in final} == {3}  # the last step: recording it adds no step to the run
    assert read_rank(tmp_path / "a", 0).footer.steps.recorded == (0, 3)  # type: ignore[union-attr]
    model, optimizer = _fresh()
    _train(model, optimizer, range(4))
    assert final[0]["digest"] == detrace.fingerprint(model.inner.weight.detach()).digest


def test_a_change_after_the_last_step_is_a_divergence_after_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _run(a)
    _run(b)
    _run(c, after=1e-3)
    assert detrace.diff(a, b).verdict == "identical"
    result = detrace.diff(a, c)
    assert result.verdict == "diverged"
    first = result.first
    assert first is not None and (first.phase, first.name, first.step, first.origin) == ("final", "inner.weight", 3,
                                                                                         True)
    assert main(["diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: rank 0, after the last step (3), the final state: inner.weight (param)" in out
    assert "it changed after the last optimizer step" in out


def test_a_run_that_ends_early_is_not_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, range(6))
    _run(b, range(4))
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("diverged: B stopped after global step 3 and A ran on to step 5: the runs do not cover "
                          "the same steps")


def test_a_resumed_run_that_trains_nothing_records_its_state_and_is_not_identical(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, range(6))
    model, optimizer = _fresh()
    _train(model, optimizer, range(3))
    saved = model.state_dict(), optimizer.state_dict()
    with detrace.trace(b, rung="semantic"):
        set_step(3, source="explicit")  # SGD keeps no step count to read it from
        model, optimizer = _fresh()
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])  # and the epoch loop overshoots: no step
    # (a subset: another test's optimizer still alive in this process is found too, as a program's own would be)
    assert {"inner.weight", "inner.bias", "head.weight", "head.bias", "Model"} <= {r["name"] for r in _final(b)}
    result = detrace.diff(a, b)
    assert result.verdict == "diverged"
    assert result.first is not None and result.first.stop is not None
    assert result.first.stop.startswith("B trained no step (it began at global step 3 and stopped there) and A ran on "
                                        "to step 5")


def _train_and_save(path: Path, *, after: float) -> None:
    """A `main()` that trains, changes its model after the last step, saves it, and returns: its model is freed
    before the trace closes, so only the saved file holds the final state."""
    model, optimizer = _fresh()
    _train(model, optimizer, range(3))
    with torch.no_grad():
        model.head.bias.add_(after)
    torch.save({"model": model.state_dict(), "step": 3}, path)


def test_the_tensors_saved_after_the_last_step_are_the_final_state(tmp_path: Path) -> None:
    runs = {}
    for name, after in (("a", 0.0), ("b", 0.0), ("c", 1e-3)):
        (tmp_path / f"ckpt-{name}").mkdir()
        with detrace.trace(tmp_path / name, rung="semantic"):
            _train_and_save(tmp_path / f"ckpt-{name}" / "final.pt", after=after)
        runs[name] = tmp_path / name
    saved = [(r["name"], r["role"]) for r in _final(runs["a"]) if r["role"] == "saved"]
    assert saved == [("final.pt:model.inner.weight", "saved"), ("final.pt:model.inner.bias", "saved"),
                     ("final.pt:model.head.weight", "saved"), ("final.pt:model.head.bias", "saved")]
    assert detrace.diff(runs["a"], runs["b"]).verdict == "identical"
    first = detrace.diff(runs["a"], runs["c"]).first
    assert first is not None and (first.phase, first.name, first.role) == ("final", "final.pt:model.head.bias",
                                                                          "saved")


def test_a_save_before_the_last_step_is_not_the_final_state(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "a", rung="semantic"):
        model, optimizer = _fresh()
        _train(model, optimizer, range(2))
        torch.save(model.state_dict(), tmp_path / "mid.pt")
        _train(model, optimizer, range(2, 4))
    assert not [r for r in _final(tmp_path / "a") if r["role"] == "saved"]


def test_no_final_state_outside_the_step_window(tmp_path: Path) -> None:
    """A run recorded over steps 0-1 of 4 (locate's narrow runs): its end is not the state of the recorded steps,
    and two runs may part after the window, so nothing is recorded there."""
    with detrace.trace(tmp_path / "a", rung="semantic", steps="0-1"):
        model, optimizer = _fresh()
        _train(model, optimizer, range(4))
        torch.save(model.state_dict(), tmp_path / "end.pt")
    assert _final(tmp_path / "a") == []


def _train_a_stage(out: Path, *, after: float = 0.0, stage_module: bool = False) -> None:
    """A pipeline rank that keeps the whole model but steps only its stage's layer (the head); then an unseeded draw
    on another stage's layer (not this rank's to train), and `after` added to the head."""
    with detrace.trace(out, rung="semantic"):
        model, _ = _fresh()
        # the stage module of the whole model's layer, a model of its own, which names the head's parameters otherwise
        stage = nn.Sequential(model.head) if stage_module else model.head
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
        for i in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            optimizer.zero_grad()
            stage(model.inner(x).detach()).square().mean().backward()
            optimizer.step()
        with torch.no_grad():
            model.inner.weight.add_(torch.randn(4, 4))
            model.head.bias.add_(after)


def test_the_final_state_holds_the_parameters_an_optimizer_stepped(tmp_path: Path) -> None:
    """The layers a rank never stepped stay at their initial values on that rank, which is not the state it trained
    (check-topology's pp2 ranks disagreed on them at the end): the end records the stepped parameters; a change to
    them after the last step is still caught."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _train_a_stage(a)
    _train_a_stage(b)
    _train_a_stage(c, after=1e-3)
    assert [(r["name"], r["role"]) for r in _final(a)] == [("head.weight", "param"), ("head.bias", "param"),
                                                           ("Model", "model")]
    assert detrace.diff(a, b).verdict == "identical"  # the draw on inner.weight is not this rank's state
    first = detrace.diff(a, c).first
    assert first is not None and (first.phase, first.step, first.name) == ("final", 2, "head.bias")


def test_a_stepped_parameter_is_recorded_once_under_the_name_its_steps_gave_it(tmp_path: Path) -> None:
    """The stage module that holds the whole model's layer is a model of its own: the head's parameters are recorded
    once as the run ends, under the names of their optimizer steps."""
    _train_a_stage(tmp_path / "a", stage_module=True)
    rows = read_rank(tmp_path / "a", 0).table.to_pylist()
    stepped = [r["name"] for r in rows if r["phase"] == "optimizer" and r["role"] == "param" and r["step"] == 2]
    assert len(stepped) == 2
    assert [r["name"] for r in _final(tmp_path / "a") if r["role"] == "param"] == stepped


def test_a_parameter_two_roots_hold_is_named_by_the_larger_one_whatever_their_order() -> None:
    """A pipeline stage built from a whole model's blocks holds the same parameters under other names: the whole
    model names them, whichever of the two the garbage collector lists first (it listed them in creation order, so
    a stage made first named them `0.weight` in one run and `blocks.1.weight` in another)."""
    from detrace.record.names import parameter_names

    for stage_first in (True, False):
        blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
        stage = torch.nn.Sequential(blocks[1]) if stage_first else None
        whole = torch.nn.Module()
        whole.blocks = torch.nn.ModuleList(blocks)
        if stage is None:
            stage = torch.nn.Sequential(blocks[1])
        names = parameter_names()
        assert names[id(blocks[1].weight)] == "blocks.1.weight", stage_first
        assert names[id(stage[0].bias)] == "blocks.1.bias"
