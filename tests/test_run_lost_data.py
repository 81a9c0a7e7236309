"""Lost data, issue 23: child processes keep apart from the ranks, torn traces are named, a full disk and SIGTERM
leave a trace that says so."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import detrace
from detrace.cli import main as cli
from detrace.tracefile import open_run
from detrace.tracefile.layout import aux_trace_paths, rank_path
from detrace.tracefile.reader import iter_batches
from detrace.tracing.session import RECORDING_VAR

PY = sys.executable


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
