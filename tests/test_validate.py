"""The validation matrix: its commands, its verdict cells, its table and its errors; and one real row
through `detrace check` / `detrace check-resume`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from detrace.examples import validate
from detrace.examples.validate import CONFIGS, FAST, Cell, Config, main, table

SINGLE = Config(name="single index", nproc=1, args=("--dispatch", "index"), threads=2)
DDP = Config(name="ddp x2", nproc=2, args=("--parallel", "ddp"), threads=1)


def test_commands_launch_the_trainer_directly_or_under_torchrun() -> None:
    single = SINGLE.command(steps=3, deterministic=False)
    assert single[1:] == ["-m", "detrace.examples.train", "--steps", "3", "--threads", "2",
                          "--dispatch", "index", "--no-deterministic"]  # fmt: skip
    ddp = DDP.command(steps=3, deterministic=True)
    assert ddp[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert ddp[-1] == "--deterministic"


def test_nondeterministic_path_needs_index_dispatch_and_two_threads() -> None:
    assert SINGLE.nondeterministic_path
    assert not DDP.nondeterministic_path
    assert not Config(name="f", nproc=1, args=("--dispatch", "fixed"), threads=2).nondeterministic_path
    assert set(FAST) <= {c.name for c in CONFIGS}
    assert {"dp-ep x4", "pp-dp x4"} <= {c.name for c in CONFIGS}


@pytest.mark.parametrize(
    "code,report,deterministic,expected",
    [
        (0, {"identical": True}, True, Cell("identical", True)),
        (1, {"diffs": [{"first": {"step": 2, "rank": 0, "name": "loss"}}]}, True,
         Cell("diverged at step 2 rank 0 loss", False)),
        (1, {"diffs": [{"first": {"step": 1, "rank": 1, "name": "aten.index_put.default"}}]}, False,
         Cell("detected at step 1 rank 1 aten.index_put.default", True)),
        (0, {"identical": True}, False, Cell("NOT detected (runs identical)", False)),
        (1, None, True, Cell("error: ImportError: boom", False)),
    ],
)  # fmt: skip
def test_check_cells(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int, report: object, deterministic: bool, expected: Cell
) -> None:
    monkeypatch.setattr(validate, "_detrace", lambda args, timeout: (code, report, "ImportError: boom"))
    assert validate._check(SINGLE, steps=3, deterministic=deterministic, out=tmp_path, timeout=1) == expected


def test_resume_cells(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    answers = iter([(0, {"verdict": "exact"}, ""), (2, {"verdict": "unproven"}, "control matched"), (2, None, "")])
    monkeypatch.setattr(validate, "_detrace", lambda args, timeout: next(answers))
    assert validate._resume(SINGLE, steps=4, at=2, out=tmp_path, timeout=1) == Cell("exact (at 2)", True)
    assert validate._resume(SINGLE, steps=4, at=2, out=tmp_path, timeout=1) == Cell("unproven: control matched", False)
    assert validate._resume(SINGLE, steps=4, at=2, out=tmp_path, timeout=1) == Cell("error: exit 2", False)


def test_table_marks_only_failures() -> None:
    rows = [(SINGLE, Cell("identical", True), Cell("exact (at 2)", True), Cell("detected", True), 3.2),
            (DDP, Cell("diverged", False), Cell("exact (at 2)", True), Cell("n/a", None), 10.0)]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[0].startswith("| config") and "nondeterminism detected without recipe" in lines[0]
    assert lines[1].startswith("|---")
    assert "✗" not in lines[2] and "| 3 s" in lines[2]
    assert "✗ diverged" in lines[3] and "✗ n/a" not in lines[3]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(CONFIGS)


@pytest.mark.parametrize(
    "argv,message",
    [(["--only", "nope"], "unknown config 'nope'"), (["--at", "4", "--steps", "4"], "--at 4"), (["--bogus"], "bogus")],
)
def test_errors_are_one_sentence(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("detrace validate: error: ") and message in err and "\n" not in err


@pytest.mark.slow
def test_one_real_row(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "detrace", "validate", "--only", "single index", "--steps", "3", "--at", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    row = proc.stdout.splitlines()[-1]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "| identical" in row and "exact (at 1)" in row and "detected" in row
