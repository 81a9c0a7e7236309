"""A loop written with accelerate directly (examples/accelerate_train.py, a BatchNorm, 2 DataLoader workers): with
`detrace.integrations.accelerate.register` and the DataLoader `accelerator.prepare` returned, `detrace check-resume`
proves its resume exact in one process; under torchrun at 2 ranks, with the registration (from a periodic
checkpoint) and with a TrainState and a ResumableLoader kept beside `save_state` / `load_state` as
docs/integrations.md shows (stopped and resumed), a run resumed after step 2 ends with the continuous run's
parameters, and each rank saved its own BatchNorm statistics (the negative control diverging is shown once, by
check-resume in one process)."""

from __future__ import annotations

import json
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


def test_the_loop_resumes_exactly_at_two_ranks_in_both_modes(tmp_path: Path) -> None:
    reports, ckpt = {mode: tmp_path / f"{mode}.jsonl" for mode in ("register", "beside")}, tmp_path / "ckpt"
    # registered (with its prepared DataLoader): one continuous run that also keeps a checkpoint after step 2,
    # resumed from it
    _torchrun("register", reports["register"], DETRACE_CKPT_DIR=str(ckpt / "register"), DETRACE_CKPT_EVERY="2")
    _torchrun("register", reports["register"], DETRACE_CKPT_DIR=str(tmp_path / "b"),
              DETRACE_RESUME_FROM=str(ckpt / "register" / "checkpoint-2"))
    # beside, the contract as docs/integrations.md's loop follows it: continuous, stopped after step 2, resumed
    _torchrun("beside", reports["beside"])
    _torchrun("beside", reports["beside"], DETRACE_CKPT_DIR=str(ckpt / "beside"), DETRACE_STOP_AT="2")
    _torchrun("beside", reports["beside"], DETRACE_CKPT_DIR=str(ckpt / "beside"), DETRACE_RESUME="1")
    for report in reports.values():
        arms = sorted_arms(report)
        assert len(arms["continuous"]) == 1 and arms["resumed"] == arms["continuous"], arms
    # The model's BatchNorm statistics differ by rank (each rank's forward updates its own): each rank saved its own.
    manifest = next((ckpt / "register" / "checkpoint-2" / "detrace").glob("step-*/manifest.json"))
    tensors = json.loads(manifest.read_text())["tensors"]
    assert {f"rank{rank}/model.1.running_mean" for rank in (0, 1)} <= set(tensors)
