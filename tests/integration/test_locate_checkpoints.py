"""The checkpointed ladder: the resume contract's periodic checkpoints and chosen versions (DETRACE_CKPT_EVERY,
DETRACE_RESUME_FROM), and `detrace locate` resuming its narrow rungs from them on the reference workload's planted
late race (`--nondeterministic-from`), falling back to full runs when the resume is not exact."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from _tools import locate_cli

from detrace import TrainState
from detrace.errors import CheckpointError, UsageError
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


# A loop that draws its data from a counter file, so that every run differs from the one before (INJECTED FAULT 1,
# a run-to-run difference), and exits 5 when it is traced at the module rung (INJECTED FAULT 2: it stands for a
# rung that breaks the program, as module hooks once broke Dynamo).
RUNG_FAULT_SCRIPT = '''
import json, os, sys
from pathlib import Path
import torch

counter = Path(sys.argv[1])
run = int(counter.read_text()) + 1 if counter.exists() else 0
counter.write_text(str(run))
if json.loads(os.environ.get("DETRACE_TRACE", "{}")).get("rung") == "module":
    sys.exit(5)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.full((2, 4), float(run))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
'''


def test_a_failure_only_under_a_narrow_rung_names_that_rung_in_json(tmp_path: Path) -> None:
    script = tmp_path / "fails_under_module.py"
    script.write_text(RUNG_FAULT_SCRIPT)
    done = locate_cli("--json", "--out", str(tmp_path / "out"), "--", sys.executable, str(script),
                      str(tmp_path / "runs.txt"))
    assert done.returncode == 2, done.stderr
    payload = json.loads(done.stdout)  # one JSON object, and nothing else, on stdout
    assert payload["schema"] == "detrace.locate/1" and payload["verdict"] == "error"
    message = payload["message"]
    assert "CMD exited with status 5 in run 2-module-a" in message
    assert "ran to completion at the semantic rung, so detrace's module rung made it fail" in message
    assert "fails on its own" not in message and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [["--timeout", "-1", "--", "true"], ["--", "detrace-no-such-command-xyz"]])
def test_every_error_is_one_json_object_with_json(tmp_path: Path, args: list[str]) -> None:
    done = locate_cli("--json", "--out", str(tmp_path / "out"), *args)
    assert done.returncode == 2
    payload = json.loads(done.stdout)
    assert payload["verdict"] == "error" and payload["message"] and "Traceback" not in done.stderr
    assert f"detrace locate: error: {payload['message']}" in done.stderr


# The reference workload with a planted late race: deterministic for 4 steps, then the MoE index dispatch's real
# race.
PLANTED = [sys.executable, "-m", "detrace.workload.train", "--preset", "tiny", "--threads", "2",
           "--nondeterministic-from", "4"]


@pytest.mark.slow
def test_planted_late_race_is_located_from_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the README's long-runs paragraph quotes this run: same command, 8 steps
    done = locate_cli("--json", "--out", str(out), "--checkpoint-every", "2", "--", *PLANTED, "--steps", "8")
    assert done.returncode == 1, done.stdout + done.stderr
    payload = json.loads(done.stdout)
    culprit = payload["culprit"]
    assert culprit["name"].startswith("aten.index_put") and culprit["phase"] == "backward"
    assert culprit["module"].endswith(".moe") and culprit["origin"] is True and culprit["step"] >= 4
    cost = payload["cost"]
    assert cost["resume"] == "exact" and cost["checkpoint_every"] == 2 and cost["runs"] == len(payload["runs"])
    runs = {run["run"]: run for run in cost["per_run"]}
    assert runs["1-semantic-a"] == {**runs["1-semantic-a"], "start": 0, "steps": 8}
    proofs = [run for name, run in runs.items() if name.startswith("2-resume-")]
    assert 1 <= len(proofs) <= 2 and all(2 <= run["start"] < 4 and run["steps"] <= 3 for run in proofs)
    narrow = [run for name, run in runs.items() if name[0] not in "12"]
    assert narrow and all(run["rung"] in ("module", "op") for run in narrow)
    for run in narrow:  # from the last checkpoint at or before the divergence, at most window + 1 steps
        assert 4 <= run["start"] <= culprit["step"] and 1 <= run["steps"] <= 3, run
    assert (out / "checkpoints" / "1-semantic-a" / "step-00000004").is_dir()
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    quoted = re.search(r"culprit `aten.index_put` at step (\d+); `cost`: (\d+) runs, \*\*(\d+) steps\*\*", readme)
    assert quoted is not None and [int(n) for n in quoted.groups()] == [culprit["step"], cost["runs"], cost["steps"]]


@pytest.mark.slow
def test_inexact_resume_falls_back_to_full_runs(tmp_path: Path) -> None:
    # The negative control (DETRACE_RESUME_CONTROL=skip-rng: resume without the RNG states; the router jitter
    # draws from the global RNG every step) makes every resume of CMD inexact: the proof must catch it, and no
    # narrow run may resume.
    out = tmp_path / "out"
    done = locate_cli("--json", "--out", str(out), "--checkpoint-every", "1", "--", *PLANTED, "--steps", "5",
                      env={"DETRACE_RESUME_CONTROL": "skip-rng"})
    payload = json.loads(done.stdout)
    assert payload["cost"]["resume"] == "inexact", done.stderr
    ladder = json.loads((out / "ladder.json").read_text())
    proof = next(stage for stage in ladder["stages"] if stage["rung"] == "resume")
    assert "run A" in proof["note"] and "every narrow run is a full run" in proof["note"]
    assert ladder["notes"][0] == proof["note"]
    # then what the audit of run A said of the culprit (detrace.investigate.audit.report.prediction)
    assert [note.split(":")[0][:32] for note in ladder["notes"][1:]] in ([], ["the audit of the first run predi"],
                                                                          ["the audit of the first run did n"])
    narrow = [run for run in payload["cost"]["per_run"] if run["run"][0] not in "12"]
    assert narrow and all(run["start"] == 0 and run["steps"] == 5 for run in narrow)


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
