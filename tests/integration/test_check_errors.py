"""`detrace check` and `detrace check-resume` on bad input: one clear sentence, exit 2, the user's files kept. The
README tour (tests/e2e/test_readme_tour.py) runs the real check that catches a real race and the real one-process
check-resume; the framework cases run check-resume at 2 ranks under torchrun (tests/e2e/test_hf_ddp_resume.py,
test_integrations_lightning.py); TrainState's exact resume under DDP and FSDP2 is tests/e2e/test_resume.py; every
verdict, message and JSON field is decided in process on synthetic traces (tests/unit/test_check_resume_logic.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from detrace.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--runs", "1", "--", "python"], "--runs must be at least 2"),
        (["check"], "no command given"),
        (["check-resume", "--", "python"], "--at is required: the step(s) to stop after"),
        (["check-resume", "--recover", "x", "--at", "2"], "--recover OUT goes alone"),
        (["check-resume", "--at", "0", "--", "python"], "--at must be a step of at least 1"),
        (["check-resume", "--at", "2,x", "--", "python"], "--at must be a step of at least 1"),
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


def test_check_refuses_a_non_empty_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    assert main(["check", "--out", str(tmp_path), "--", sys.executable, "-c", "pass"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"
