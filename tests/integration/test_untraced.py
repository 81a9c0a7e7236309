"""A run whose tracer did not start in CMD: `detrace run`'s summary says so and why, and every command given such a
run says "nothing was recorded", in one sentence, exit 2 (issue 36: the run said "trace of 0 ranks ... written", and
check-resume then blamed the run's length).

The commands that run CMD are given a CMD that leaves the note of a failed start itself (a stand-in, named as such:
no torch import, so each run costs a Python start-up); one real process shows the start-up hook's own note.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _synthetic import SyntheticRun, write_run

from detrace.cli import main as cli
from detrace.errors import NothingRecorded
from detrace.tracefile import open_run
from detrace.tracefile.layout import run_header_path, untraced_paths
from detrace.tracefile.writer import write_json_atomic

PY = sys.executable
REASON = "a made-up reason"
STAND_IN = f"from detrace.launch.inject import note_untraced; note_untraced({REASON!r})"
"""CMD whose tracer 'did not start': it leaves the note the start-up hook leaves, without importing torch."""


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_the_start_up_hooks_reason_is_the_runs_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The real start-up hook, refused by a malformed variable: its note becomes run.json's `untraced`."""
    monkeypatch.setenv("DETRACE_STEP_OFFSET", "x")
    out = tmp_path / "a"
    assert cli(["run", "--out", str(out), "--", PY, "-c", "import torch; torch.ones(2).sum()"]) == 0
    (untraced,) = json.loads(run_header_path(out).read_text())["untraced"]
    assert untraced["reason"].startswith("DETRACE_STEP_OFFSET must be a non-negative integer")
    summary = _last_line(capsys.readouterr().err)
    assert summary.startswith(f"detrace run: nothing was recorded in {out} (")
    assert summary.endswith(f"exit code 0): the tracer did not start in process {untraced['pid']}: "
                            f"{untraced['reason']}")
    assert not untraced_paths(out)  # folded into run.json


def test_a_run_with_no_note_says_no_process_recorded_anything(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a"
    assert cli(["run", "--out", str(out), "--", PY, "-c", "raise SystemExit(3)"]) == 3
    assert _last_line(capsys.readouterr().err).endswith(
        "exit code 3): no process of its command recorded anything; the tracer starts in each Python process that "
        "imports torch, and records its ops and steps")
    with pytest.raises(NothingRecorded, match=r"nothing was recorded in .*: no process of its command"):
        open_run(out)


def test_a_cmd_that_ends_on_detraces_refusal_is_said_to_be_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """CMD stopped by one of detrace's own refusals (a contract variable refused) before it recorded anything: the
    summary said "no process of its command recorded anything; the tracer starts in each Python process...", which
    sent the user looking for a tracer that had started. It says the refusal (a stand-in raises it: no torch)."""
    out = tmp_path / "a"
    refused = "DETRACE_CKPT_EVERY must be a step number of at least 1, not '0'"
    code = f"from detrace.errors import UsageError; raise UsageError({refused!r})"
    assert cli(["run", "--out", str(out), "--", PY, "-c", code]) == 1
    err = capsys.readouterr().err
    assert f"detrace.errors.UsageError: {refused}\n" in err  # CMD's own traceback, passed on as it was
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("detrace run: CMD ended on detrace's refusal (")
    assert summary.endswith(f"exit code 1), before anything was recorded in {out}: {refused}")
    assert "the tracer starts" not in summary


@pytest.fixture
def untraced(tmp_path: Path) -> Path:
    """What `detrace run` leaves of a CMD whose tracer did not start: run.json, with its note folded in."""
    run = tmp_path / "untraced"
    run.mkdir()
    write_json_atomic(run_header_path(run), {"command": [PY, "train.py"], "status": "finished", "returncode": 0,
                                             "untraced": [{"pid": 4242, "reason": REASON}]})
    return run


@pytest.mark.parametrize("argv", [
    ["diff", "{run}", "{traced}"], ["diff", "{traced}", "{run}"], ["certify", "{run}"], ["spikes", "{run}"],
    ["report", "{run}", "--out", "{tmp}/r.html"], ["compare", "{traced}", "{traced}", "{run}"],
    ["recheck", "{run}", "--step", "0", "--out", "{tmp}/recheck"],
    ["ablate", "--run", "{run}", "--step", "1", "--out", "{tmp}/ablate", "--", PY, "train.py"],
], ids=lambda argv: argv[0])
def test_every_command_given_the_run_says_nothing_was_recorded(argv: list[str], untraced: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    traced = tmp_path / "traced"
    write_run(traced, SyntheticRun(ranks=1, steps=2, ops=2))
    assert cli([a.format(run=untraced, traced=traced, tmp=tmp_path) for a in argv]) == 2
    assert _last_line(capsys.readouterr().err).endswith(
        f"error: nothing was recorded in {untraced}: the tracer did not start in process 4242: {REASON}")


@pytest.mark.parametrize("argv", [
    ["check"], ["check-resume", "--at", "1"], ["locate"], ["audit"],
], ids=lambda argv: argv[0])
def test_every_command_that_runs_cmd_stops_at_the_first_run(argv: list[str], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli([*argv, "--out", str(out), "--", PY, "-c", STAND_IN]) == 2
    (run,) = out.rglob("run.json")  # one run, no second
    (untraced,) = json.loads(run.read_text())["untraced"]
    assert _last_line(capsys.readouterr().err).endswith(
        f"error: nothing was recorded in {run.parent}: the tracer did not start in process {untraced['pid']}: {REASON}")
