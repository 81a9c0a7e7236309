"""The checkpointed ladder: the resume contract's periodic checkpoints and chosen versions (DETRACE_CKPT_EVERY,
DETRACE_RESUME_FROM), and `detrace locate` falling back to full runs when resuming is not exact (in process, through
its launch seam, on synthetic traces and real TrainState checkpoints). The real ladder that resumes its narrow rungs
from checkpoints, on the reference workload's planted late race (`--nondeterministic-from`), is in
tests/e2e/test_locate_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _ladders import Scripted
from _synthetic import Fault, SyntheticRun

from detrace import TrainState
from detrace.errors import CheckpointError, UsageError
from detrace.investigate.locate import LocateConfig, locate
from detrace.state import ResumableSampler
from detrace.state.contract import saved_versions
from detrace.workload.train import TrainConfig, parse_args


def _state() -> TrainState:
    model = torch.nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=ResumableSampler(8))


def test_checkpoint_every_keeps_every_version_and_resume_from_picks_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(ckpt))
    monkeypatch.setenv("DETRACE_CKPT_EVERY", "2")
    state = _state()
    weights = {}
    for step in range(1, 7):
        state.model.weight.data.fill_(float(step))
        weights[step] = state.model.weight.detach().clone()
        assert not state.end_of_step(step)  # periodic saves never stop the loop
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert (ckpt / "latest").read_text() == "step-00000006\n"

    # Resume from a chosen version, and stop there: the stop's save goes to DETRACE_CKPT_DIR, the others stay.
    monkeypatch.delenv("DETRACE_CKPT_EVERY")
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "scratch"))
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(ckpt / "step-00000004"))
    resumed = _state()
    assert resumed.resume_if_requested() == 4
    assert torch.equal(resumed.model.weight, weights[4])
    monkeypatch.setenv("DETRACE_STOP_AT", "5")
    assert resumed.end_of_step(5)
    assert (tmp_path / "scratch" / "latest").read_text() == "step-00000005\n"
    assert len([p for p in ckpt.iterdir() if p.name.startswith("step-")]) == 3


def test_saved_versions_lists_complete_checkpoints_in_every_layout(tmp_path: Path) -> None:
    # TrainState's step-N/, transformers' checkpoint-N/ (detrace's state in detrace/), Lightning's step-N.ckpt
    # (detrace's state in step-N.ckpt.detrace/): what `detrace locate` finds in run A's checkpoint directory.
    root = tmp_path / "ckpt"
    state = _state()
    state.step = 2
    state.save(root, keep=9)
    hf, lightning = root / "checkpoint-4", root / "step-00000006.ckpt"
    hf.mkdir()
    state.save(hf / "detrace")
    lightning.write_bytes(b"lightning's own file")
    state.save(Path(f"{lightning}.detrace"))
    # incomplete: a framework checkpoint without detrace's state, a version whose manifest is missing
    (root / "checkpoint-8").mkdir()
    (root / "step-00000010.ckpt").write_bytes(b"")
    (root / "step-00000012").mkdir()
    assert saved_versions(root) == {2: root / "step-00000002", 4: hf, 6: lightning}
    assert saved_versions(tmp_path / "nowhere") == {}


@pytest.mark.parametrize("value", ["0", "often", "-2"])
def test_checkpoint_every_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    message = f"DETRACE_CKPT_EVERY must be a step number of at least 1, not '{value}'"
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("DETRACE_CKPT_EVERY", value)
    with pytest.raises(UsageError, match=message):
        _state().end_of_step(1)


def test_resume_from_a_missing_checkpoint_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from detrace.errors import CheckpointError

    monkeypatch.setenv("DETRACE_RESUME_FROM", str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="there is no checkpoint at"):
        _state().resume_if_requested()


def test_nondeterministic_from_checks() -> None:
    assert parse_args(["--nondeterministic-from", "3"]).nondeterministic_from == 3
    with pytest.raises(UsageError, match="needs --dispatch index and no --deterministic"):
        TrainConfig(nondeterministic_from=3, deterministic=True)
    with pytest.raises(UsageError, match="needs --dispatch index"):
        TrainConfig(nondeterministic_from=3, dispatch="fixed")
    with pytest.raises(UsageError, match="must be 0 or more"):
        TrainConfig(nondeterministic_from=-1)


# A single process, 5 steps, checkpoints after every step: the race parts the broad pair at step 3 on rank 0, so
# the proof resumes from the checkpoint after step 1 and must reproduce run A over step 2.
LATE = SyntheticRun(ranks=1, steps=5, ops=8)
LATE_RACE = Fault(rank=0, step=3, op=3)
BAD_RESUME = Fault(rank=0, step=2, op=1)  # INJECTED FAULT: a resumed run's step 2 differs from run A's
OTHER_BAD_RESUME = Fault(rank=0, step=1, op=0)  # INJECTED FAULT: every record of its step 2 differs


@pytest.mark.parametrize("resumes_agree", [True, False], ids=["resume-inexact", "race-in-the-proof-window"])
def test_inexact_resume_falls_back_to_full_runs(tmp_path: Path, resumes_agree: bool) -> None:
    # A resume that loses part of the state (as DETRACE_RESUME_CONTROL=skip-rng does to the reference trainer)
    # makes every resumed run differ from run A: the proof must catch it, and no narrow run may resume. When the
    # two resumed runs also differ from each other, the nondeterminism itself strikes in the proof window.
    launcher = Scripted(second_arm=True, run=LATE, race=LATE_RACE, checkpoints=True, resume_fault=BAD_RESUME,
                        resume_faults={} if resumes_agree else {"2-resume-b": OTHER_BAD_RESUME})
    out = tmp_path / "out"
    result = locate(LocateConfig(command=("python", "train.py"), out=out, checkpoint_every=1,
                                 env={"DETRACE_RESUME_CONTROL": "skip-rng"}), launch=launcher)
    assert result.verdict == "nondeterministic" and result.culprit is not None
    assert (result.culprit.step, result.culprit.rank, result.culprit.origin) == (3, 0, True)
    assert result.cost is not None and result.cost.resume == "inexact" and result.cost.checkpoint_every == 1
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-resume-a", "2-resume-b", "3-module-a",
                             "3-module-b", "4-op-a", "4-op-b", "5-capture"]
    # every run got CMD's own environment; the proof resumed from run A's checkpoint after step 1
    assert all(env["DETRACE_RESUME_CONTROL"] == "skip-rng" for env in launcher.envs.values())
    assert launcher.envs["2-resume-a"]["DETRACE_RESUME_FROM"] == str(out / "checkpoints" / "1-semantic-a" /
                                                                     "step-00000001")
    ladder = json.loads((out / "ladder.json").read_text())
    proof = next(stage for stage in ladder["stages"] if stage["rung"] == "resume")
    assert proof["steps"] == "2-2" and "run A" in proof["note"] and "every narrow run is a full run" in proof["note"]
    assert ("differ from run A and from each other" in proof["note"]) is not resumes_agree
    assert ladder["notes"] == [proof["note"]]  # no audit ran: no prediction note after it
    narrow = [run for run in result.cost.to_json()["per_run"] if run["run"][0] not in "12"]
    assert narrow and all(run["start"] == 0 and run["steps"] == LATE.steps for run in narrow)
    assert all("DETRACE_RESUME_FROM" not in launcher.envs[run["run"]] for run in narrow)


def _failed_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume_from: Path) -> str:
    """The message of a narrow run that resumes from `resume_from` and fails (its launch stands in: CMD exits 1)."""
    from detrace.investigate.locate import driver
    from detrace.investigate.locate.config import LocateConfig
    from detrace.investigate.locate.stages import RunFailed, StageRun
    from detrace.launch.launcher import LaunchResult

    def launch(cmd: list[str], out: Path, **_: object) -> LaunchResult:
        return LaunchResult(returncode=1, out=Path(out), command=tuple(cmd), elapsed=0.1,
                            output_tail="CheckpointCorrupted: ...")

    ladder = driver.Ladder(LocateConfig(command=("python", "train.py"), out=tmp_path / "out"), launch=launch)
    ladder.completed.append("module")  # the module rung ran to completion before: the old verdict blamed it
    stage = StageRun(rung="module", steps="3", ranks="all", start=2, resume_from=str(resume_from))
    with pytest.raises(RunFailed) as failed:
        ladder._run(stage, "3-module-a", rung="module",
                    contract={"DETRACE_CKPT_DIR": str(tmp_path / "c"), "DETRACE_RESUME_FROM": str(resume_from)})
    return str(failed.value)


def test_locate_names_a_corrupted_or_deleted_checkpoint_not_its_own_rung(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    version = state.save(tmp_path / "ckpt")
    state_file = version / "rank-0.json"
    state_file.write_text(state_file.read_text() + " ")  # edited after the save (an injected fault)
    message = _failed_resume(tmp_path, monkeypatch, version)
    assert "the checkpoint it resumes from is corrupted (CheckpointCorrupted:" in message
    assert "rung made it fail" not in message
    message = _failed_resume(tmp_path, monkeypatch, tmp_path / "ckpt" / "step-00000009")
    assert f"{tmp_path / 'ckpt' / 'step-00000009'}, is gone (no checkpoint)" in message
    assert "rung made it fail" not in message


def test_an_unwritable_checkpoint_dir_is_refused_when_the_train_state_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(blocker / "ckpt"))
    monkeypatch.setenv("DETRACE_STOP_AT", "3")
    with pytest.raises(CheckpointError, match=r"DETRACE_CKPT_DIR=.*cannot be written \(.*a-file is not a directory"):
        _state()  # before: the run trained 3 steps, then failed at its first save
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "new" / "ckpt"))
    _state()  # a directory still to be made is fine
    assert not (tmp_path / "new").exists()
