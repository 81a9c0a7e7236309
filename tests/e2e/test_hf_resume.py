"""Acceptance on third-party code: an unmodified HF `Trainer` script (tests/support/scripts/hf_trainer.py, a tiny GPT-2
from a config, no download), traced continuous and traced resumed from its own `checkpoint-4` with HF's
`resume_from_checkpoint`. Nothing tells the tracer the step: the restored AdamW state carries it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main
from detrace.tracefile import read_rank
from detrace.tracefile.metadata import StepAccount

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parents[1] / "support" / "scripts" / "hf_trainer.py")


def _traced_pair(tmp_path: Path, *flags: str) -> tuple[str, str]:
    checkpoints = str(tmp_path / "hf")
    a, b = str(tmp_path / "continuous"), str(tmp_path / "resumed")
    command = [sys.executable, SCRIPT, "--out", checkpoints, *flags]
    assert main(["run", "--out", a, "--rung", "semantic", "--", *command]) == 0
    assert (tmp_path / "hf" / "checkpoint-4").is_dir()
    assert main(["run", "--out", b, "--rung", "semantic", "--", *command, "--resume"]) == 0
    return a, b


def test_hf_trainer_resumed_from_its_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _traced_pair(tmp_path, "--augment")
    footer = read_rank(b, 0).footer
    assert footer is not None and footer.steps == StepAccount(first=4, recorded=(4, 7), source="optimizer")
    capsys.readouterr()
    # The augmentation draws from torch's RNG, which HF restores as it was when checkpoint-4 was saved, not as the
    # continuous run had it when it fetched step 4's batch.
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "compared global steps 4-7 (B resumed after step 4)" in out
    assert "first divergence: rank 0, step 4, the input batch (input[0], call #0) [numeric]" in out
    assert "the input batch differs" in out
    assert main(["diff", a, b, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["compared"]["steps"] == {"first": 4, "last": 7}
    assert (report["first"]["step"], report["first"]["phase"], report["first"]["name"]) == (4, "data", "batch")
