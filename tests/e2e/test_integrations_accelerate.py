"""A loop written with accelerate directly (examples/accelerate_train.py, 2 DataLoader workers): with
`detrace.integrations.accelerate.register`, `detrace check-resume` proves its resume exact in one process; under
torchrun at 2 ranks, with the registration and with a TrainState kept beside `save_state` / `load_state` as
docs/integrations.md shows, a run resumed after step 2 ends with the continuous run's parameters (the negative
control diverging is shown once, by check-resume in one process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _integrations import arms as sorted_arms
from _integrations import torchrun_example

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "accelerate_train.py"


def test_check_resume_proves_the_registered_loop_exact(tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "check"), "--", sys.executable, str(SCRIPT),
                 "--workers", "2", "--report", str(report)])
    assert code == 0
    arms = sorted_arms(report)
    assert len(arms["continuous"]) == 1 and arms["resumed"] == arms["continuous"]
    assert arms["control"] and arms["control"].isdisjoint(arms["continuous"])
    # accelerate's own files are there, with detrace's verified checkpoint inside.
    saved = tmp_path / "check" / "at-2" / "checkpoint" / "checkpoint-2"
    assert (saved / "model.safetensors").is_file() and (saved / "detrace").is_dir()


def _torchrun(mode: str, report: Path, **contract: str) -> None:
    torchrun_example(SCRIPT, "--mode", mode, "--workers", "2", "--report", str(report), env=contract)


@pytest.mark.parametrize("mode", ["register", "beside"])
def test_the_loop_resumes_exactly_at_two_ranks(tmp_path: Path, mode: str) -> None:
    report, ckpt = tmp_path / "report.jsonl", str(tmp_path / "ckpt")
    if mode == "register":  # one continuous run that also keeps a checkpoint after step 2, resumed from it
        _torchrun(mode, report, DETRACE_CKPT_DIR=ckpt, DETRACE_CKPT_EVERY="2")
        resume = {"DETRACE_CKPT_DIR": str(tmp_path / "b"), "DETRACE_RESUME_FROM": f"{ckpt}/checkpoint-2"}
        _torchrun(mode, report, **resume)
    else:  # the contract as docs/integrations.md's loop follows it: stop after step 2, resume
        _torchrun(mode, report)
        _torchrun(mode, report, DETRACE_CKPT_DIR=ckpt, DETRACE_STOP_AT="2")
        _torchrun(mode, report, DETRACE_CKPT_DIR=ckpt, DETRACE_RESUME="1")
    arms = sorted_arms(report)
    continuous = arms["continuous"]  # with DETRACE_CKPT_EVERY, the run goes on to its last step
    assert len(continuous) == 1 and arms["resumed"] == continuous
