"""End to end, the step count of `detrace check-resume --native`'s resumed run: SGD with momentum (no step count in
its state) resumes `exact`, and its checkpoint that forgot the optimizer is named as such (the resumed run counts on
from the step of the checkpoint it loads, not from the optimizer's state; both ended in "nothing was recorded";
plain SGD, whose state is empty, is counted the same way, in process). And the
DCP resume torch's docs teach (`get_state_dict` / `dcp.save`,
then `dcp.load` / `set_state_dict`), under torchrun at 2 ranks on gloo: `exact`. torch initialises the resumed
process's fresh optimizer with a zero-lr optimizer step inside `get_state_dict`, which fires the global optimizer
step hooks; counted as training step 1, it made this correct resume `resume-changed-the-run` with every part
differing. The logic is in tests/integration/test_step_count.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parents[1] / "support" / "scripts"
SCRIPT = str(SCRIPTS / "dcp_state_dict_resume.py")


def test_an_sgd_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "2", "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, str(SCRIPTS / "sgd_resume.py"), "--steps", "4", "--momentum"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (0, "exact"), report


def test_an_sgd_checkpoint_without_the_optimizer_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "2", "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, str(SCRIPTS / "sgd_resume.py"), "--steps", "4", "--momentum", "--no-optimizer"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (1, "resume-changed-the-run"), report
    assert "does your checkpoint save the optimizer's state_dict" in report["forgot"]


def test_the_dcp_state_dict_resume_at_two_ranks_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "2", "--resume-args=--resume", "--out", str(tmp_path / "check"),
                 "--json", "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 SCRIPT, "--steps", "4"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (0, "exact"), report
    [point] = report["points"]
    assert point["resume"]["verdict"] == "identical"
    assert all(c["equal"] is not False for c in point["restored"]), point["restored"]
