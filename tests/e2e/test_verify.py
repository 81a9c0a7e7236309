"""`detrace check` and `detrace check-resume` end to end, on real commands in real processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

TOY = str(Path(__file__).parents[1] / "support" / "scripts" / "resume_toy.py")
PLAIN_MOE = str(Path(__file__).parents[2] / "examples" / "plain_moe_train.py")

pytestmark = pytest.mark.slow


def test_check_passes_a_deterministic_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--out", str(tmp_path / "c"), "--json", "--", sys.executable, TOY, "--steps", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True and len(report["runs"]) == 2
    assert report["diffs"][0]["verdict"] == "identical" and report["diffs"][0]["compared"]["records"] > 0


def test_check_catches_real_nondeterminism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # index_put with accumulate over repeated indices, at 2 threads: no fault is injected. The race is real and
    # strikes in nearly every backward (each expert takes its tokens in priority order).
    code = main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, PLAIN_MOE, "--steps", "2",
                 "--threads", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "run 2 differs from run 1" in out and "first divergence: rank 0, step 0" in out


def _check_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str, at: str = "2",
                  json_out: bool = True) -> tuple[int, dict | str]:
    code = main(["check-resume", "--at", at, "--out", str(tmp_path / "r"), *(["--json"] if json_out else []), "--",
                 sys.executable, TOY, "--steps", "4", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if json_out else out


def test_check_resume_exact_on_a_real_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Every verdict and several stop points are decided in process (test_check_resume_logic.py); this is the
    # real thing once: a TrainState loop stopped after step 2, resumed in a fresh process, and its control.
    # (The human form of an exact verdict is asserted by the README tour test, on the reference workload.)
    code, report = _check_resume(tmp_path, capsys, at="2")
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


def test_check_resume_catches_a_resume_bug(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The script forgets to put the optimizer in its TrainState: AdamW restarts with empty moments.
    code, out = _check_resume(tmp_path, capsys, "--forget-optimizer", json_out=False)
    assert code == 1, out
    assert out.startswith("resume-changed-the-run: resuming after step 2 changed the run") and "step 2" in out


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


# A loop with optimizer steps but no TrainState: traced and repeatable, but it cannot stop and resume.
NO_CONTRACT = ("import torch; torch.manual_seed(0); m = torch.nn.Linear(2, 1)\n"
               "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
               "for _ in range(3): m(torch.ones(2)).sum().backward(); o.step()")


@pytest.mark.parametrize(("code", "message"), [
    (NO_CONTRACT, "wrote no checkpoint to {out}/at-1/checkpoint when asked to stop after step 1; does it use "
                  "detrace.TrainState (resume_if_requested / end_of_step)"),
    ("import accelerate\n" + NO_CONTRACT, "does it use detrace.integrations.accelerate.register(accelerator)"),
    ("pass", "leaves no step to resume"),
])
def test_check_resume_on_a_command_without_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        code: str, message: str) -> None:
    """The message names the integration that fits what the script imports (tests/unit/test_advice.py has the rules)."""
    script = tmp_path / "train.py"
    script.write_text(code)
    out = tmp_path / "o"
    assert main(["check-resume", "--at", "1", "--out", str(out), "--", sys.executable, str(script)]) == 2
    assert message.format(out=out) in capsys.readouterr().err


def test_check_refuses_a_non_empty_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    assert main(["check", "--out", str(tmp_path), "--", sys.executable, "-c", "pass"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "user data"
