"""Where a program's checkpoint saves end up (detrace.record.rungs.checkpoint_files), in this process: a file saved
under a temporary name and renamed into place, and a save into memory whose bytes the program writes to a file,
each logged under the file a later load reads, so that check-resume --native's skip-rng control finds its RNG
states there."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import detrace
from detrace.tracefile.checkpoints import read_checkpoint_log


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _checkpoint(model: torch.nn.Module) -> dict[str, object]:
    return {"model": model.state_dict(), "rng": torch.get_rng_state()}


def test_saves_renamed_into_place_name_the_final_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    model = torch.nn.Linear(3, 1)
    with detrace.trace(tmp_path / "run"):
        torch.save(_checkpoint(model), "a.pt.tmp")
        os.replace("a.pt.tmp", "a.pt")  # the atomic-write idiom
        torch.save(_checkpoint(model), tmp_path / "b.tmp")
        (tmp_path / "b.tmp").rename(tmp_path / "b.pt")  # pathlib calls os.rename
        torch.save(_checkpoint(model), "c.pt")
        shutil.move("c.pt", "kept")  # into a folder: kept/c.pt
        (tmp_path / "staging").mkdir()
        torch.save(_checkpoint(model), "staging/d.pt")
        os.rename("staging", "step-1")  # the folder holding a save
        torch.save(_checkpoint(model), "e.pt")  # never renamed
        (tmp_path / "other.txt").write_text("x")
        os.replace("other.txt", "other2.txt")  # no save's file: nothing logged
    log = read_checkpoint_log(tmp_path / "run")
    assert [io.paths for io in log] == [("a.pt",), (str(tmp_path / "b.pt"),), ("kept/c.pt",), ("step-1/d.pt",),
                                        ("e.pt",)]
    assert all(io.rng == (("torch", ("rng",)),) for io in log)  # the RNG states go with the file
    lines = (tmp_path / "run").glob("checkpoints-*.jsonl")
    assert sum(line.count('"rename"') for path in lines for line in path.read_text().splitlines()) == 4


def test_skip_rng_finds_the_rng_states_of_a_file_saved_under_a_temporary_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(3, 1)
    torch.manual_seed(1)
    with detrace.trace(tmp_path / "stopped"):
        saved = _checkpoint(model)
        torch.save(saved, "ckpt.pt.tmp")
        os.replace("ckpt.pt.tmp", "ckpt.pt")
    [io] = read_checkpoint_log(tmp_path / "stopped")
    # check-resume --native hands the resumed run the stopped run's RNG key paths, per file (its absolute path)
    monkeypatch.setenv("DETRACE_NATIVE_CONTROL", "skip-rng")
    monkeypatch.setenv("DETRACE_NATIVE_RNG", json.dumps(
        {str(tmp_path / path): [[kind, list(key_path)] for kind, key_path in io.rng] for path in io.paths}))
    torch.manual_seed(2)
    with detrace.trace(tmp_path / "control"):
        loaded = torch.load("ckpt.pt")
    assert torch.equal(loaded["rng"], torch.get_rng_state()) and not torch.equal(loaded["rng"], saved["rng"])
    assert [io.control for io in read_checkpoint_log(tmp_path / "control")] == ["skip-rng"]


def test_a_save_into_memory_names_the_file_its_bytes_land_in(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (tmp_path / "ckpt").mkdir()
    with detrace.trace(tmp_path / "run"):
        for step in range(3):
            _step(model, optimizer)
            buffer = io.BytesIO()
            buffer.write(b"header")  # the save starts where the buffer is
            start = buffer.tell()
            torch.save(_checkpoint(model), buffer)
            buffer.write(b"more")  # the buffer can still grow: the tracer holds no view of it
            if step < 2:
                (tmp_path / "ckpt" / "last.pt").write_bytes(buffer.getvalue()[start:-4])
            else:
                uploaded = buffer.getvalue()  # (sent elsewhere: found in no file)
    log = read_checkpoint_log(tmp_path / "run")
    assert [(io.completed, io.in_memory) for io in log] == [(1, True), (2, True), (3, True)]
    assert [io.paths for io in log] == [(str(tmp_path / "ckpt" / "last.pt"),)] * 2 + [()]
    assert log[0].rng == (("torch", ("rng",)),) and uploaded


def test_the_last_save_into_memory_is_found_as_the_trace_closes(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with detrace.trace(tmp_path / "run"):
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buffer)
        with open("final.pt", "wb") as stream:
            stream.write(buffer.getbuffer())
    [io_] = read_checkpoint_log(tmp_path / "run")
    assert io_.paths == (str(tmp_path / "final.pt"),) and io_.in_memory


def test_a_load_from_memory_of_the_stopped_runs_file_gets_the_control(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1)
    with detrace.trace(tmp_path / "stopped"):
        buffer = io.BytesIO()
        saved = {"rng": torch.get_rng_state()}
        torch.save(saved, buffer)
        Path("ckpt.pt").write_bytes(buffer.getvalue())
    [io_] = read_checkpoint_log(tmp_path / "stopped")
    monkeypatch.setenv("DETRACE_NATIVE_CONTROL", "skip-rng")
    monkeypatch.setenv("DETRACE_NATIVE_RNG", json.dumps(
        {path: [[kind, list(key_path)] for kind, key_path in io_.rng] for path in io_.paths}))
    torch.manual_seed(2)
    with detrace.trace(tmp_path / "control"):
        loaded = torch.load(io.BytesIO(Path("ckpt.pt").read_bytes()))
    assert torch.equal(loaded["rng"], torch.get_rng_state()) and not torch.equal(loaded["rng"], saved["rng"])
    [loading] = read_checkpoint_log(tmp_path / "control")
    assert (loading.paths, loading.control) == ((str(tmp_path / "ckpt.pt"),), "skip-rng")


def test_check_resume_native_refuses_a_stop_point_saved_into_memory_and_found_in_no_file(tmp_path: Path) -> None:
    from detrace.errors import UsageError
    from detrace.investigate.native_resume import NativeContract
    from detrace.tracefile.checkpoints import CheckpointIO

    contract = NativeContract(["train"], out=tmp_path / "out", root=tmp_path, at=[2])

    def saves(*paths: tuple[str, ...]) -> list[CheckpointIO]:
        return [CheckpointIO(op="save", api="torch.save", completed=2 * (n + 1), paths=p, pid=1, in_memory=True)
                for n, p in enumerate(paths)]

    contract._saved_at(2, saves(("ckpt/last.pt",), ()))  # landed in a file: the check goes on
    with pytest.raises(UsageError, match=r"^CMD saved its checkpoint after step 2 into memory \(torch.save into a "
                                         r"buffer\) and its bytes are in no file under the working directory"):
        contract._saved_at(2, saves((), ("ckpt/last.pt",)))
