"""End to end: a correct resume of a loop that draws no random number after the stop (DDP, a seeded
`ResumableSampler`, AdamW, no dropout: tests/support/scripts/ddp_no_randomness.py) is `exact`: the RNG control
changes nothing, the data control diverges, and the verdict says so. One rank (a DDP of world 1), for CI's time:
the controls do not depend on the world size (the same check under torchrun at 2 ranks: docs/resume.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parents[1] / "support" / "scripts" / "ddp_no_randomness.py")


def test_a_loop_without_randomness_is_proven_by_its_data_position(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-resume", "--at", "3", "--out", str(tmp_path / "check"), "--json", "--", sys.executable,
                 SCRIPT])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (0, "exact"), report
    [point] = report["points"]
    assert [(c["control"], c["mattered"]) for c in point["controls"]] == [("skip-rng", False), ("skip-data", True)]
    assert point["depends"].startswith("after step 3 this run depends on its data position, not on its RNG states")
    assert report["first"]["step"] == 3
