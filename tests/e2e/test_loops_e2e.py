"""End to end, issue #46's acceptance on loops written the way people write them (examples/loops/, each with its
true verdicts in its docstring): `check` of a seeded loop whose FLOPs are counted on meta tensors first is
identical (the tracer neither crashes on the meta tensors nor records them), and `check-resume --native` calls a
resume that trains nothing (an epoch loop that overshoots) and one that forgets an EMA copy
`resume-changed-the-run`. docs/resume.md's table ("Verdicts on loops written the way people write them") holds
every command's verdict on every loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

LOOPS = Path(__file__).parents[2] / "examples" / "loops"


def test_a_flop_count_on_meta_tensors_then_training_is_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check", "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, str(LOOPS / "meta_flops.py"), "--steps", "4"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["identical"]) == (0, True), report


def test_a_resume_whose_epoch_loop_overshoots_changed_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "6", "--resume-args=--resume", "--out", str(tmp_path / "check"),
                 "--json", "--", sys.executable, str(LOOPS / "epoch_overshoot.py")])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (1, "resume-changed-the-run"), report
    # the resumed run trained no step after 6, where the continuous one ran on: its step 6 is missing
    assert (report["first"]["kind"], report["first"]["step"]) == ("missing", 6), report["first"]


def test_a_resume_that_forgets_the_ema_copy_changed_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "2", "--resume-args=--resume", "--out", str(tmp_path / "check"),
                 "--json", "--", sys.executable, str(LOOPS / "ema_forgotten.py"), "--steps", "4"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (1, "resume-changed-the-run"), report
    # the model and the optimizer were restored: only the EMA file saved at the end tells the runs apart
    assert "ema.pt" in json.dumps(report), report
