"""Lost data, issue 23: child processes keep apart from the ranks, torn traces are named, a full disk and SIGTERM
leave a trace that says so."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _synthetic import SyntheticRun, rank_table, write_table

import detrace
from detrace.cli import main as cli
from detrace.locate import LocateConfig, driver, locate
from detrace.report.terminal import diff_lines
from detrace.tracefile import open_run
from detrace.tracefile.layout import aux_trace_paths, rank_path
from detrace.tracefile.reader import iter_batches
from detrace.tracing.launch import LaunchResult
from detrace.tracing.session import RECORDING_VAR

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
    assert header["aux"] is True and header["rank"] is None
    assert sum(batch.num_rows for batch in iter_batches(aux)) > 0


def test_a_recording_process_marks_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORDING_VAR, raising=False)
    with detrace.trace(tmp_path / "run", rung="op"):
        torch.ones(2) + 1
        assert os.environ[RECORDING_VAR] == str(os.getpid())
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
