"""The step count is the tracer's own count of training optimizer steps, plus the steps completed at the save of the
checkpoint a resumed process loads (check-resume --native hands the stopped run's saves over): never an
optimizer's `state["step"]` (SGD keeps none; a checkpoint may leave the optimizer out), and never an optimizer step
run inside a checkpoint load or by torch's initialisation of a fresh optimizer's state (DCP's state-dict helpers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import detrace
from detrace.errors import UsageError
from detrace.state.contract import ENV_NATIVE_SAVED
from detrace.tracefile import read_rank
from detrace.tracefile.checkpoints import read_checkpoint_log


def _fresh(momentum: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.Generator().manual_seed(step)
        loss = nn.functional.mse_loss(model(torch.randn(8, 4, generator=x)), torch.zeros(8, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _steps(run: Path) -> list[int]:
    return sorted(set(read_rank(run, 0).table.column("step").to_pylist()))


@pytest.mark.parametrize(("momentum", "saved_parts"), [(0.0, ("model", "optimizer")), (0.9, ("model", "optimizer")),
                                                       (0.9, ("model",))])
def test_a_resumed_process_counts_on_from_the_checkpoint_it_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, momentum: float, saved_parts: tuple[str, ...]) -> None:
    """SGD with or without momentum, and a checkpoint that forgot the optimizer: no step count to read anywhere
    but the stopped run's log of its save."""
    model, optimizer = _fresh(momentum)
    with detrace.trace(tmp_path / "stopped", rung="semantic"):
        _train(model, optimizer, range(3))
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({part: state[part] for part in saved_parts}, tmp_path / "step-3.pt")
    [save] = read_checkpoint_log(tmp_path / "stopped")
    monkeypatch.setenv(ENV_NATIVE_SAVED, json.dumps({path: save.completed for path in save.paths}))
    model, optimizer = _fresh(momentum)
    with detrace.trace(tmp_path / "resumed", rung="semantic"):
        saved = torch.load(tmp_path / "step-3.pt")
        model.load_state_dict(saved["model"])
        if "optimizer" in saved:
            optimizer.load_state_dict(saved["optimizer"])
        _train(model, optimizer, range(3, 6))
    assert _steps(tmp_path / "resumed") == [3, 4, 5]
    footer = read_rank(tmp_path / "resumed", 0).footer
    assert footer is not None and footer.steps is not None
    assert (footer.steps.first, footer.steps.source) == (3, "checkpoint")
    [load] = read_checkpoint_log(tmp_path / "resumed")
    assert (load.op, load.completed) == ("load", 3)


def test_a_load_of_a_file_the_stopped_run_did_not_save_leaves_the_count_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _fresh(0.0)
    torch.save(model.state_dict(), tmp_path / "init.pt")
    monkeypatch.setenv(ENV_NATIVE_SAVED, json.dumps({str(tmp_path / "step-3.pt"): 3}))
    with detrace.trace(tmp_path / "run", rung="semantic"):
        model.load_state_dict(torch.load(tmp_path / "init.pt"))
        _train(model, optimizer, range(2))
    assert _steps(tmp_path / "run") == [0, 1]


def test_a_malformed_list_of_saves_is_refused_in_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_NATIVE_SAVED, "[3")
    backward, meta_path = torch.autograd.backward, list(sys.meta_path)
    with pytest.raises(UsageError, match="DETRACE_NATIVE_SAVED is not the saves of check-resume"), \
            detrace.trace(tmp_path / "run"):
        pass
    # the refusal comes from a rung installed after others: what they replaced is put back (the program the
    # start-up hook lets run on must run untouched; a later tracer wrapped a dead one's torch.autograd.backward)
    assert torch.autograd.backward is backward and sys.meta_path == meta_path


def test_dcp_initialising_a_fresh_optimizer_is_no_training_step(tmp_path: Path) -> None:
    """`get_state_dict` on an optimizer that never stepped runs torch's zero-lr `optimizer.step()`, which fires the
    global step hooks: the first training step is still step 0, and the records of that initialisation are
    checkpoint work, apart from the training."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fresh(0.9)
    with detrace.trace(tmp_path / "run", rung="semantic"):
        get_state_dict(model, optimizer)
        optimizer.zero_grad()
        _train(model, optimizer, range(3))
    table = read_rank(tmp_path / "run", 0).table
    assert _steps(tmp_path / "run") == [0, 1, 2]
    phases = {(step, phase) for step, phase in zip(table.column("step").to_pylist(), table.column("phase").to_pylist(),
                                                    strict=True)}
    assert (0, "optimizer") in phases
    footer = read_rank(tmp_path / "run", 0).footer
    assert footer is not None and footer.steps is not None and footer.steps.first == 0
