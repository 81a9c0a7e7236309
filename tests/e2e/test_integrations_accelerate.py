"""A loop written with accelerate directly, with `TrainState` beside `accelerator.save_state`/`load_state`
(examples/accelerate_train.py): `detrace check-resume` proves the resume exact with 2 DataLoader workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _integrations import arms as sorted_arms

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "accelerate_train.py"


def test_check_resume_proves_the_accelerate_loop_exact(tmp_path: Path) -> None:
    report = tmp_path / "report.jsonl"
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "check"), "--", sys.executable, str(SCRIPT),
                 "--workers", "2", "--report", str(report)])
    assert code == 0
    arms = sorted_arms(report)
    assert len(arms["continuous"]) == 1 and arms["resumed"] == arms["continuous"]
    assert arms["control"] and arms["control"].isdisjoint(arms["continuous"])
    # accelerate's own files are there too, beside detrace's verified checkpoint.
    assert (tmp_path / "check" / "at-2" / "checkpoint" / "accelerate" / "model.safetensors").is_file()
