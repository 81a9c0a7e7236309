"""The tracer sees a program's own checkpoints (detrace.record.rungs.checkpoints), in this process: `torch.save` /
`torch.load` and safetensors files, logged with the optimizer steps completed and the files named, and the negative
controls of check-resume --native applied to what `torch.load` returns."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import detrace
from detrace.tracefile.checkpoints import read_checkpoint_log


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_saves_and_loads_are_logged_with_their_step_and_files(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    with detrace.trace(tmp_path / "run"):
        model, optimizer = _trained()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "step-2.pt")
        safetensors.save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
        with open(tmp_path / "step-2.pt", "rb") as stream:
            torch.load(stream)
        safetensors.load_file(str(tmp_path / "model.safetensors"))
    log = read_checkpoint_log(tmp_path / "run")
    assert [(io.op, io.api, io.completed) for io in log] == [
        ("save", "torch.save", 2), ("save", "safetensors.save_file", 2), ("load", "torch.load", 2),
        ("load", "safetensors.load_file", 2)]
    assert log[0].paths == (str(tmp_path / "step-2.pt"),) and log[2].paths == log[0].paths  # a file object's name
    assert all(io.control is None for io in log)
    torch.save({}, tmp_path / "untraced.pt")  # the tracer's wrappers are gone with it
    assert len(read_checkpoint_log(tmp_path / "run")) == 4


@pytest.mark.parametrize("control", ["skip-optimizer", "skip-rng"])
def test_the_native_controls_change_what_the_program_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           control: str) -> None:
    model, optimizer = _trained()
    torch.manual_seed(1)
    random.seed(1)
    with detrace.trace(tmp_path / "saving"):  # the stopped run: its save says where its RNG states are
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                 "states": [{"python": random.getstate()}],
                 "pair": (torch.ones(3), 3),  # a tuple that is no RNG state
                 "buffer": torch.get_rng_state().clone()}  # an RNG state's shape and dtype, not one: left alone
        torch.save(saved, tmp_path / "ckpt.pt")
    [io] = read_checkpoint_log(tmp_path / "saving")
    assert io.rng == (("torch", ("rng",)), ("python", ("states", 0, "python")))
    torch.manual_seed(2)
    random.seed(2)
    monkeypatch.setenv("DETRACE_NATIVE_CONTROL", control)
    monkeypatch.setenv("DETRACE_NATIVE_RNG", json.dumps({str(tmp_path / "ckpt.pt"): [list(i) for i in io.rng]}))
    with detrace.trace(tmp_path / "run"):
        loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert torch.equal(loaded["model"]["weight"], saved["model"]["weight"])  # the model is always restored
    assert torch.equal(loaded["pair"][0], saved["pair"][0]) and torch.equal(loaded["buffer"], saved["buffer"])
    if control == "skip-optimizer":
        assert loaded["optimizer"]["state"] == {}
        assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
        assert torch.equal(loaded["rng"], saved["rng"])
    else:
        assert torch.equal(loaded["rng"], torch.get_rng_state()) and not torch.equal(loaded["rng"], saved["rng"])
        assert loaded["states"][0]["python"] == random.getstate() != saved["states"][0]["python"]
        assert loaded["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    [io] = read_checkpoint_log(tmp_path / "run")
    assert io.control == control


def test_a_checkpoint_call_inside_another_is_logged_once(tmp_path: Path) -> None:
    """torch.distributed.checkpoint writes its items with torch.save: the DCP save is the one logged."""
    import torch.distributed.checkpoint as dcp

    with detrace.trace(tmp_path / "run"):
        model, _ = _trained()
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    log = read_checkpoint_log(tmp_path / "run")
    assert [(io.op, io.api, io.completed, io.paths) for io in log] == [
        ("save", "dcp.save", 2, (str(tmp_path / "dcp"),)), ("load", "dcp.load", 2, (str(tmp_path / "dcp"),))]


@pytest.mark.parametrize("control", ["skip-optimizer", "skip-rng"])
def test_the_native_controls_apply_to_what_dcp_loads_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              control: str) -> None:
    """torch.distributed.checkpoint fills the state dict it is given: the control changes it before the program
    hands it to the optimizer (`set_state_dict`) or to torch's RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _trained()
    with detrace.trace(tmp_path / "saving"):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state, "rng": torch.get_rng_state()},
                 checkpoint_id=str(tmp_path / "dcp"))
    [saved] = read_checkpoint_log(tmp_path / "saving")
    assert saved.rng == (("torch", ("rng",)),)
    torch.manual_seed(5)
    monkeypatch.setenv("DETRACE_NATIVE_CONTROL", control)
    monkeypatch.setenv("DETRACE_NATIVE_RNG", json.dumps({str(tmp_path / "dcp"): [list(i) for i in saved.rng]}))
    fresh = torch.nn.Linear(3, 1)
    restored = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with detrace.trace(tmp_path / "run"):
        model_state, optimizer_state = get_state_dict(fresh, restored)
        state = {"model": model_state, "optim": optimizer_state, "rng": torch.empty_like(torch.get_rng_state())}
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
        set_state_dict(fresh, restored, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert torch.equal(fresh.weight, model.weight)  # the model is always restored
    assert (len(restored.state) == 0) == (control == "skip-optimizer")
    assert torch.equal(state["rng"], torch.get_rng_state()) == (control == "skip-rng")
    [io] = read_checkpoint_log(tmp_path / "run")
    assert (io.api, io.control) == ("dcp.load", control)


def test_skip_rng_reaches_into_a_safetensors_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    with detrace.trace(tmp_path / "saving"):
        safetensors.save_file({"rng": torch.get_rng_state(), "w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    [saved] = read_checkpoint_log(tmp_path / "saving")
    torch.manual_seed(7)
    monkeypatch.setenv("DETRACE_NATIVE_CONTROL", "skip-rng")
    monkeypatch.setenv("DETRACE_NATIVE_RNG", json.dumps({str(tmp_path / "a.safetensors"): [["torch", ["rng"]]]}))
    with detrace.trace(tmp_path / "run"):
        loaded = safetensors.load_file(str(tmp_path / "a.safetensors"))
    assert saved.rng == (("torch", ("rng",)),)
    assert torch.equal(loaded["rng"], torch.get_rng_state()) and torch.equal(loaded["w"], torch.ones(2))
    assert read_checkpoint_log(tmp_path / "run")[0].control == "skip-rng"


def test_lightning_saves_are_logged_with_their_file(tmp_path: Path) -> None:
    """Lightning saves into a buffer with torch.save and writes it through fsspec: its `_atomic_save` is logged, with
    the file, once."""
    torch_io = pytest.importorskip("lightning.fabric.plugins.io.torch_io")
    with detrace.trace(tmp_path / "run"):
        torch_io.TorchCheckpointIO().save_checkpoint({"w": torch.ones(2), "rng": torch.get_rng_state()},
                                                      tmp_path / "ckpts" / "step=2.ckpt")
    [io] = read_checkpoint_log(tmp_path / "run")
    assert (io.op, io.api, io.paths) == ("save", "lightning._atomic_save", (str(tmp_path / "ckpts" / "step=2.ckpt"),))
    assert io.rng == (("torch", ("rng",)),)
