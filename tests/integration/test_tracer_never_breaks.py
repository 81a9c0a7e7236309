"""The tracer never breaks the program it traces: tensors without data (meta tensors, a FakeTensorMode) are not
recorded, and a record that cannot be made is a note in the trace (the footer's warnings, which the verdicts
repeat), never an exception in the program. In this process; a meta-tensor program through `detrace check` is in
tests/e2e/test_loops_e2e.py (examples/loops/meta_flops.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import detrace
import detrace.digest
from detrace.tracefile import read_rank
from detrace.tracefile.layout import footer_path
from detrace.tracefile.schema import RUNGS


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _warnings(run: Path) -> list[str]:
    """The footer's warnings (`detrace.record.warned`, and the records that could not be made)."""
    return json.loads(footer_path(run, 0).read_text()).get("warnings", [])


def _flop_count_on_meta() -> None:
    """What litgpt's pretrain does before training: a forward and backward of the model on meta tensors."""
    with torch.device("meta"):
        model = _model()
        model(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("rung", [r for r in RUNGS if r != "kernel"])
def test_a_model_run_on_meta_tensors_is_not_recorded(tmp_path: Path, rung: str) -> None:
    untraced = _train(3)
    with detrace.trace(tmp_path / "run", rung=rung):
        _flop_count_on_meta()
        traced = _train(3)
    assert traced == untraced
    rank = read_rank(tmp_path / "run", 0)
    assert sorted(set(rank.table.column("step").to_pylist())) == [0, 1, 2]
    assert rank.table.column("name").to_pylist().count("loss") == 3  # the meta loss is not one
    assert not _warnings(tmp_path / "run")


def test_a_model_run_on_meta_tensors_numbers_no_batch(tmp_path: Path) -> None:
    """litgpt's pretrain counts FLOPs on a meta copy of the model at the start of each process: the resumed run's
    does it in the step where it resumes. That forward is no batch of the step: its real batch is the step's first
    call, as in the continuous run (before, it was call #1, and check-resume --native called litgpt's exact resume
    resume-changed-the-run, 'the sequence of calls changed' at the resumed run's first step)."""
    with detrace.trace(tmp_path / "run", rung="semantic"):
        _flop_count_on_meta()
        _train(2)
    rows = read_rank(tmp_path / "run", 0).table.to_pylist()
    assert [(r["step"], r["occurrence"]) for r in rows if r["name"] == "batch"] == [(0, 0), (1, 0)]


def test_a_fake_tensor_mode_is_not_recorded(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with detrace.trace(tmp_path / "run", rung="op"):
        model = _model()
        with FakeTensorMode(allow_non_fake_inputs=True):
            model(torch.randn(4, 8)).sum().backward()
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 8)).sum().backward()
    rank = read_rank(tmp_path / "run", 0)
    assert not _warnings(tmp_path / "run") and rank.table.num_rows > 0


def test_a_record_that_cannot_be_made_is_a_note_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    untraced = _train(3)

    def broken(values: list[object]) -> list[object]:
        raise RuntimeError("injected fault in the fingerprint")

    monkeypatch.setattr(detrace.digest, "fingerprint_many", broken)
    with detrace.trace(tmp_path / "run", rung="semantic"):
        traced = _train(3)
    assert traced == untraced
    [note] = _warnings(tmp_path / "run")
    assert note.endswith("records could not be made: RuntimeError: injected fault in the fingerprint"), note
    assert int(note.split()[0]) > 0
    # only the records that needed a fingerprint are lost (none is written without its digest): the losses stay
    table = read_rank(tmp_path / "run", 0).table
    assert table.column("name").to_pylist().count("loss") == 3 and set(table.column("digest").to_pylist()) == {None}
    assert "a record could not be made in process" in capsys.readouterr().err


@pytest.mark.parametrize(("rung", "module", "name"), [
    ("module", "detrace.record.rungs.module", "recorded_leaves"),
    ("semantic", "detrace.record.rungs.semantic.optimizer", "parameter_names"),
])
def test_a_failing_hook_is_a_note_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rung: str, module: str,
                                              name: str) -> None:
    """A fault in a rung's own hook code (not in a fingerprint): the hook gives up, the program goes on."""
    untraced = _train(3)

    def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("injected fault in a hook")

    monkeypatch.setattr(f"{module}.{name}", broken)
    with detrace.trace(tmp_path / "run", rung=rung):
        traced = _train(3)
    assert traced == untraced
    [note] = _warnings(tmp_path / "run")
    assert note.endswith("could not be made: KeyError: 'injected fault in a hook'"), note


def test_a_wrapper_that_fails_as_a_module_loads_does_not_fail_the_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What the tracer wraps as the program imports it (torch.distributed.checkpoint): its own failure there leaves
    the module imported."""
    import importlib

    from detrace.record.patch import after_import

    (tmp_path / "watched_by_detrace.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ran: list[str] = []

    def wrap() -> None:
        ran.append("wrap")
        raise RuntimeError("injected fault in a wrapper")

    undo = after_import(["watched_by_detrace"], wrap)
    try:
        assert importlib.import_module("watched_by_detrace").VALUE == 3
    finally:
        undo()
        sys.modules.pop("watched_by_detrace", None)
    assert ran == ["wrap"]
    assert "watched_by_detrace holds was not wrapped (RuntimeError: injected fault" in capsys.readouterr().err
