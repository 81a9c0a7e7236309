"""Lost data, issue 23: child processes keep apart from the ranks, torn traces are named, a full disk and SIGTERM
leave a trace that says so."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _synthetic import SyntheticRun, rank_table, write_table

import detrace
from detrace.cli import main as cli
from detrace.errors import CheckpointError
from detrace.investigate.locate import LocateConfig, driver, locate
from detrace.launch import launcher as launch
from detrace.launch.launcher import LaunchResult
from detrace.record.config import RECORDING_VAR
from detrace.report.terminal import diff_lines
from detrace.state import checkpoint
from detrace.tracefile import RankWriter, open_run, writer
from detrace.tracefile.layout import aux_trace_paths, rank_path
from detrace.tracefile.reader import iter_batches

PY = sys.executable
ONE_RANK = SyntheticRun(ranks=1, steps=2, ops=2)


def test_a_process_started_by_a_recording_one_writes_an_aux_trace(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # As in an eval subprocess of torchrun's rank 0: the parent recorded, and RANK=0 came with the environment.
    monkeypatch.setenv(RECORDING_VAR, str(os.getpid() + 1))
    monkeypatch.setenv("RANK", "0")
    with detrace.trace(tmp_path / "run", rung="op"):
        torch.ones(2) + 1
    assert not rank_path(tmp_path / "run", 0).exists()
    [aux] = aux_trace_paths(tmp_path / "run")
    assert aux.name == f"aux-{os.getpid()}.arrow"
    header = iter_batches(aux).header
    assert header.raw["aux"] is True and header.rank is None
    assert sum(batch.num_rows for batch in iter_batches(aux)) > 0


def test_a_recording_process_marks_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORDING_VAR, raising=False)
    with detrace.trace(tmp_path / "run", rung="op"):
        torch.ones(2) + 1
        assert os.environ[RECORDING_VAR] == str(os.getpid())
    assert RECORDING_VAR not in os.environ  # closed: a process started now clashes with nothing
    assert rank_path(tmp_path / "run", 0).exists() and not aux_trace_paths(tmp_path / "run")


@pytest.mark.slow
def test_a_child_python_process_keeps_apart_from_the_ranks_trace(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    child = "import torch; torch.ones(2) + 1"
    code = f"import subprocess, sys, torch; torch.ones(2) + 1; subprocess.run([sys.executable, '-c', {child!r}])"
    assert cli(["run", "--out", str(out), "--rung", "op", "--", PY, "-c", code]) == 0
    header = json.loads((out / "run.json").read_text())
    [aux] = aux_trace_paths(out)
    assert header["aux"] == [aux.name] and header["traced_ranks"] == [0]
    assert cli(["certify", str(out)]) == 0
    assert list(open_run(out).ranks) == [0]
    capsys.readouterr()


def _unclosed_run(out: Path) -> Path:
    """A one-rank synthetic run whose process ended without closing its trace (as after os._exit mid-step)."""
    write_table(out, 0, rank_table(ONE_RANK, 0), world_size=1, close=False)
    return out


def test_diff_of_traces_that_end_inside_a_step_says_so(tmp_path: Path) -> None:
    result = detrace.diff(_unclosed_run(tmp_path / "a"), _unclosed_run(tmp_path / "b"))
    assert result.verdict == "identical" and result.unclosed == ["A", "B"]
    assert any(note.startswith("A's trace ends inside a step (rank 0 in step 1)") for note in result.notes)
    assert any(note.startswith("B's trace ends inside a step") for note in diff_lines(result))


def test_locate_does_not_call_a_torn_trace_deterministic_without_saying_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def launch(cmd: list[str], out: Path, **options: object) -> LaunchResult:
        _unclosed_run(Path(out))  # every run of CMD ends with os._exit in step 1: no footer
        return LaunchResult(returncode=0, out=Path(out), command=tuple(cmd), elapsed=0.1, output_tail="")

    monkeypatch.setattr(driver, "run_traced", launch)
    result = locate(LocateConfig(command=("python", "train.py"), out=tmp_path / "loc", checkpoints=False))
    assert result.verdict == "deterministic"
    assert "the traces end inside a step (step 1)" in result.message


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")  # INJECTED FAULT: a full disk


def test_a_full_disk_while_tracing_is_one_sentence_and_the_program_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(RankWriter, "add_batch", _enospc)
    with detrace.trace(tmp_path / "run", rung="op"):
        x = torch.ones(2) + 1
        detrace.step()
    assert x.tolist() == [2.0, 2.0]
    err = capsys.readouterr().err
    assert f"tracing stopped on rank 0: no space left on the device that holds {tmp_path / 'run'}" in err
    assert "the trace is cut short" in err and not (tmp_path / "run" / "rank-00000.json").exists()


def test_a_full_disk_at_exit_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(writer, "write_json_atomic", _enospc)  # the footer, written at close
    with detrace.trace(tmp_path / "run", rung="op"):
        torch.ones(2) + 1
    assert "no space left on the device" in capsys.readouterr().err


def test_a_full_disk_keeps_cmds_exit_code_and_finishes_run_json(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def full_at_the_end(path: Path, payload: dict[str, object]) -> None:
        calls.append(payload["status"])
        if payload["status"] != "running":
            _enospc()
        writer.write_json_atomic(path, payload)

    monkeypatch.setattr(launch, "write_json_atomic", full_at_the_end)
    result = launch.run_traced([PY, "-c", "pass"], tmp_path / "run", quiet=True)
    assert result.returncode == 0 and calls == ["running", "finished"]
    assert result.cut_short is not None and "no space left on the device that holds" in result.cut_short
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"  # rewritten in place


def test_a_checkpoint_on_a_full_disk_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def torn_write(*args: object, **kwargs: object) -> None:  # INJECTED FAULT: torch's writer on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.dcp, "save", torn_write)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(CheckpointError, match="no space left on the device that holds"):
        checkpoint.write(tmp_path / "ckpt", step=1, shared={"w": torch.ones(2)}, local={})


def test_sigterm_is_passed_on_and_run_json_says_interrupted(tmp_path: Path) -> None:
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        result = launch.run_traced([PY, "-c", "import time; time.sleep(60)"], tmp_path / "run", quiet=True)
    finally:
        timer.cancel()
    assert result.interrupted and result.returncode == -signal.SIGTERM and result.elapsed < 30
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"
    assert "interrupted by SIGTERM" in launch.describe(result)


def test_cmds_stderr_stays_apart_from_its_stdout(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code = "import sys; print('to-out', flush=True); print('to-err', file=sys.stderr, flush=True)"
    assert cli(["run", "--out", str(tmp_path / "run"), "--", PY, "-c", code]) == 0
    out, err = capfd.readouterr()
    assert "to-out" in out and "to-err" not in out
    assert "to-err" in err and "to-out" not in err


@pytest.mark.slow
def test_a_live_run_is_never_replaced_and_a_killed_one_is_told_from_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out, other, started = tmp_path / "run", tmp_path / "other", tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(120)"
    first = subprocess.Popen([PY, "-m", "detrace", "run", "--out", str(out), "--", PY, "-c", code],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        # both said "written to D" before, and D held only the second
        assert cli(["run", "--force", "--out", str(out), "--", PY, "-c", "pass"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"another detrace run that still runs (pid {first.pid})" in err
        assert json.loads((out / "run.json").read_text())["status"] == "running"
    finally:
        first.kill()  # SIGKILL: run.json stays "running"
        first.wait()
    table = rank_table(SyntheticRun(ranks=1, steps=2, ops=1), 0)
    write_table(out, 0, table, world_size=1)
    write_table(other, 0, table, world_size=1)
    shutil.copy(out / "run.json", other / "run.json")  # the same command and rung (a copy: no lock, no writer)
    assert cli(["diff", str(out), str(other)]) == 0
    said = capsys.readouterr()
    assert (f"{out}'s run.json says \"running\", but the detrace run that wrote it died (pid {first.pid} is gone "
            "and its lock is free)") in said.out + said.err and "still running" not in said.out + said.err
    assert cli(["run", "--force", "--out", str(out), "--", PY, "-c", "pass"]) == 0  # a dead writer's may go
