"""`detrace check` and `detrace check-resume` end to end, on real commands in real processes: one real check (a real
race caught), one check-resume on a plain command and one on DDP x2, and the errors of bad input. Every verdict,
message and JSON field is decided in process on synthetic traces (tests/unit/test_check_resume_logic.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

TOY = str(Path(__file__).parents[1] / "support" / "scripts" / "resume_toy.py")
PLAIN_MOE = str(Path(__file__).parents[2] / "examples" / "plain_moe_train.py")

pytestmark = pytest.mark.slow


def test_check_catches_real_nondeterminism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # index_put with accumulate over repeated indices, at 2 threads: no fault is injected. The race is real and
    # strikes in nearly every backward (each expert takes its tokens in priority order).
    code = main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, PLAIN_MOE, "--steps", "2",
                 "--threads", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "run 2 differs from run 1" in out and "first divergence: rank 0, step 0" in out


def test_check_resume_exact_on_a_real_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Every verdict and several stop points are decided in process (test_check_resume_logic.py); this is the
    # real thing once: a TrainState loop stopped after step 2, resumed in a fresh process, and its control, a real
    # resume defect (no RNG states), which the diff must find. Its two continuous runs are `detrace check`'s
    # proof of a deterministic command (the same launcher and diff), bit-identical.
    # (The human form of an exact verdict is asserted by the README tour test, on the reference workload.)
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "r"), "--json", "--", sys.executable, TOY,
                 "--steps", "4"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["schema"] == "detrace.check-resume/1" and report["verdict"] == "exact" and report["at"] == [2]
    assert report["repeat"]["verdict"] == "identical" and report["repeat"]["compared"]["records"] > 0
    [point] = report["points"]
    assert point["resume"]["verdict"] == "identical" and point["resumed_again"] is None
    assert point["resume"]["compared"]["steps"] == {"first": 2, "last": 3}
    assert point["control"]["verdict"] == "diverged" and set(point["runs"]) == {"stopped", "resumed", "control"}
    assert report["first"]["step"] == 2  # the control's first resumed step already differs without its RNG


def test_check_resume_exact_on_ddp_x2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The reference workload on 2 gloo ranks under torchrun: every arm is a 2-rank job.
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "r"), "--json", "--", sys.executable, "-m",
                 "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "detrace.workload.train",
                 "--preset", "tiny", "--steps", "3", "--parallel", "ddp", "--deterministic"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    [point] = report["points"]
    assert report["repeat"]["compared"]["ranks"] == 2 and point["resume"]["compared"]["ranks"] == 2
    assert point["resume"]["compared"]["steps"] == {"first": 2, "last": 2} and point["control"]["verdict"] == "diverged"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--runs", "1", "--", "python"], "--runs must be at least 2"),
        (["check"], "no command given"),
        (["check-resume", "--", "python"], "the following arguments are required: --at"),
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
