"""`detrace check` and `detrace check-resume` end to end, on real commands in real processes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from detrace.cli import main

TOY = str(Path(__file__).parent / "scripts" / "resume_toy.py")
PLAIN_MOE = str(Path(__file__).parents[1] / "examples" / "plain_moe_train.py")

pytestmark = pytest.mark.slow


def test_check_passes_a_deterministic_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--out", str(tmp_path / "c"), "--json", "--", sys.executable, TOY, "--steps", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True and len(report["runs"]) == 2
    assert report["diffs"][0]["verdict"] == "identical" and report["diffs"][0]["compared"]["records"] > 0


def test_check_catches_real_nondeterminism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # index_put with accumulate over repeated indices, at 2 threads: no fault is injected. The race is real and
    # can spare a run: 3 runs of 8 steps make "all identical" negligible (a CI rehearsal saw 2 runs of 3 agree).
    code = main(["check", "--runs", "3", "--out", str(tmp_path / "c"), "--", sys.executable, PLAIN_MOE,
                 "--steps", "8", "--threads", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"run [23] differs from run 1", out) and "first divergence" in out


def test_check_resume_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "r"), "--json", "--",
                 sys.executable, TOY, "--steps", "4"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["verdict"] == "exact"
    assert report["resume"]["verdict"] == "identical" and report["resume"]["compared"]["records"] > 0
    assert report["control"]["verdict"] == "diverged"
    assert report["control"]["first"]["step"] == 2  # the first resumed step already differs without its RNG


def test_check_resume_catches_a_resume_bug(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The script forgets to put the optimizer in its TrainState: AdamW restarts with empty moments.
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "r"), "--",
                 sys.executable, TOY, "--steps", "4", "--forget-optimizer"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "changed the run" in out and "step 2" in out


def test_check_resume_without_randomness_proves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "r"), "--",
                 sys.executable, TOY, "--steps", "4", "--no-random"])
    assert code == 2
    assert "unproven" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--runs", "1", "--", "python"], "--runs must be at least 2"),
        (["check"], "no command given"),
        (["check-resume", "--", "python"], "the following arguments are required: --at"),
        (["check-resume", "--at", "0", "--", "python"], "--at must be a step of at least 1"),
        (["check", "--", "no-such-command-detrace"], "no-such-command-detrace"),
        (["check", "--", sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], "exited with code 3"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                      message: str) -> None:
    command, rest = argv[0], argv[1:]
    code = main([command, "--out", str(tmp_path / "o"), *rest])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


def test_check_resume_on_a_command_without_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-resume", "--at", "1", "--out", str(tmp_path / "o"), "--", sys.executable, "-c", "pass"])
    assert code == 2
    assert "wrote no checkpoint" in capsys.readouterr().err


def test_check_refuses_a_non_empty_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    assert main(["check", "--out", str(tmp_path), "--", sys.executable, "-c", "pass"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"
