"""The ladder's narrowing and verdicts, in process: `locate(..., launch=)` runs a scripted command that writes
synthetic traces (tests/support/_synthetic.py) with a known answer, so each path of the ladder is checked in
milliseconds. tests/e2e/test_locate_e2e.py keeps the real ladders on real CPU nondeterminism."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _ladders import RUN, Scripted

from detrace.analyze.locate_result import LOCATE_FILE, LocateResult, load_ladder
from detrace.cli import locate as locate_cli
from detrace.investigate.locate import LocateConfig, locate
from detrace.launch.launcher import LaunchResult
from detrace.tracefile.layout import checkpoint_log_path


def _locate(tmp_path: Path, launcher: Scripted) -> LocateResult:
    return locate(LocateConfig(command=("python", "train.py"), out=tmp_path / "out"), launch=launcher)


def test_three_equal_runs_are_deterministic(tmp_path: Path) -> None:
    launcher = Scripted()
    result = _locate(tmp_path, launcher)
    assert result.verdict == "deterministic" and result.exit_code == 0 and result.culprit is None
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "1-semantic-c"]
    assert result.message == "every recorded bit of three runs is identical over 4 steps"
    assert load_ladder(tmp_path / "out").verdict == "deterministic"  # ladder.json, locate.json, the report


def test_a_recurring_race_is_narrowed_to_its_origin_op(tmp_path: Path) -> None:
    launcher = Scripted(second_arm=True)
    result = _locate(tmp_path, launcher)
    culprit = result.culprit
    assert culprit is not None and result.verdict == "nondeterministic" and result.exit_code == 1
    assert (culprit.rank, culprit.step, culprit.phase, culprit.origin) == (1, 2, "backward", True)
    assert culprit.name == "aten.add.Tensor" and culprit.module == "layers.3"  # backward op 3 of the synthetic loop
    assert [stage.rung for stage in result.stages] == ["semantic", "module", "op", "kernel"]
    assert result.stages[1].steps == "2" and result.stages[1].ranks == "1"  # the window the broad pair gave
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-module-a", "2-module-b", "3-op-a", "3-op-b",
                             "4-capture"]
    # the scripted command captures nothing, so the kernel rung says so instead of replaying
    assert result.replay is None and "recorded no call matching" in result.stages[-1].note
    # the scripted command writes no checkpoint: every narrow run is a full run, and the result says what would help
    assert result.cost is not None and result.cost.resume == "no-contract" and result.cost.checkpoint_every is None
    assert all(run["start"] == 0 and run["steps"] == RUN.steps for run in result.cost.to_json()["per_run"])
    assert result.notes[0].startswith("CMD wrote no checkpoint, so every narrow run re-ran it from step 0")


def test_a_script_with_checkpoints_of_its_own_is_pointed_to_check_resume_native(tmp_path: Path) -> None:
    """nanoGPT-like: it torch.saves a dict of its own, which the tracer logs but locate cannot resume from."""

    class OwnSaves(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: Any) -> LaunchResult:
            done = super().__call__(cmd, out, **kwargs)
            checkpoint_log_path(out, 1).write_text(json.dumps({
                "op": "save", "api": "torch.save", "completed": 2, "paths": ["out/ckpt.pt"], "pid": 1}) + "\n")
            return done

    result = _locate(tmp_path, OwnSaves(second_arm=True))
    assert result.notes[0] == (
        "CMD saves checkpoints of its own (out/ckpt.pt), which do not follow the resume contract (detrace.TrainState, "
        "docs/resume.md), so every narrow run re-ran it from step 0; `detrace check-resume --native` proves whether "
        "its own resume is exact")


def test_a_script_that_resumes_by_itself_is_refused_in_check_s_sentence(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A framework-style auto-resume (examples/loops/auto_resume.py): run b loads the checkpoint run a left in the
    script's own folder. One sentence naming the runs and the folder, exit 2: the same refusal as `detrace check`,
    not a verdict on runs that did not start from the same state, nor "no global step in common"."""

    class AutoResume(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: Any) -> LaunchResult:
            done = super().__call__(cmd, out, **kwargs)
            if Path(out).name != "1-semantic-a":
                checkpoint_log_path(out, 1).write_text(json.dumps({
                    "op": "load", "api": "torch.load", "completed": 6, "paths": ["ckpt-auto/step-6.pt"],
                    "pid": 1}) + "\n")
            return done

    launcher = AutoResume(second_arm=True)  # run b's records differ too, as they do after a resume
    assert locate_cli.main(["--json", "--out", str(tmp_path / "out"), "--", "python", "train.py"],
                           launch=launcher) == 2
    printed = capsys.readouterr()
    payload = json.loads(printed.out)
    assert payload["verdict"] == "error"
    assert payload["message"] == (
        "run 1-semantic-b loaded a checkpoint from ckpt-auto/step-6.pt and run 1-semantic-a loaded none: CMD resumes "
        "by itself from a checkpoint that an earlier run left in ckpt-auto, so the runs did not start from the same "
        "state; give each run a clean one: delete ckpt-auto before `detrace locate`, turn the script's auto-resume "
        "off, or have the script take its checkpoint folder from DETRACE_CKPT_DIR, which detrace locate sets to a "
        "new directory for each run")
    assert launcher.runs == ["1-semantic-a", "1-semantic-b"]


def test_a_difference_that_does_not_recur_is_inconclusive(tmp_path: Path) -> None:
    # Only the broad pair's second run shows the fault: a one-time event, which no rerun reproduces. The ladder
    # retries the module pair once, then says what it knows instead of guessing.
    launcher = Scripted({"1-semantic-b"})
    result = _locate(tmp_path, launcher)
    assert result.verdict == "inconclusive" and result.exit_code == 2
    assert result.culprit is not None and (result.culprit.step, result.culprit.rank) == (2, 1)
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-module-a", "2-module-b", "2-module-c", "2-module-d"]
    assert "the second arm does not reproduce it: 4 reruns at the module rung agree" in result.message
    assert "transient hardware fault" in result.message and "detrace recheck RUN --step 2" in result.message
    assert "did not recur" in result.stages[-1].note


@pytest.mark.parametrize("faulted", [{"1-semantic-b", "2-module-b", "2-module-d"}])
def test_an_op_pair_that_does_not_part_says_so(tmp_path: Path, faulted: set[str]) -> None:
    # The module rung confirms the divergence, but neither op pair parts: the ladder names the rung it stopped at.
    result = _locate(tmp_path, Scripted(faulted))
    assert result.verdict == "inconclusive"
    assert "the op-rung reruns could not pin it down" in result.message
    assert [stage.rung for stage in result.stages] == ["semantic", "module", "op"]


def test_the_cli_prints_a_deterministic_verdict_and_writes_its_json(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    # The human form on stdout; the JSON object is the locate.json the ladder writes (the same object `--json`
    # prints: tests/e2e/test_locate_e2e.py checks that on its culprit ladder).
    assert locate_cli.main(["--out", str(out), "--", "python", "train.py"], launch=Scripted()) == 0
    printed = capsys.readouterr()
    payload = json.loads((out / LOCATE_FILE).read_text())
    assert sorted(payload) == ["cost", "culprit", "replay", "report", "runs", "schema", "verdict"]
    assert payload["schema"] == "detrace.locate/1" and payload["verdict"] == "deterministic"
    assert payload["culprit"] is None and payload["replay"] is None
    assert payload["runs"] == [str(out / name) for name in ("1-semantic-a", "1-semantic-b", "1-semantic-c")]
    assert all(Path(run, "rank-00000.arrow").exists() for run in payload["runs"])
    assert Path(payload["report"]).exists()
    assert "over 4 steps" in load_ladder(out).stages[0].note
    assert "rung 1 (metrics + semantic) the three runs are bit-identical over 4 steps" in " ".join(
        printed.err.split())
    assert printed.out.startswith("deterministic over 4 steps:"), printed.out
    assert "runs     3 (of at most 14)" in printed.out


def test_a_failure_only_under_a_narrow_rung_names_that_rung_in_json(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # The broad pair runs to completion and parts; every module-rung run exits 5 (an injected fault standing for a
    # rung that breaks the program, as module hooks once broke Dynamo).
    launcher = Scripted(second_arm=True, fail_rung="module")
    assert locate_cli.main(["--json", "--out", str(tmp_path / "out"), "--", "python", "train.py"],
                           launch=launcher) == 2
    printed = capsys.readouterr()
    payload = json.loads(printed.out)  # one JSON object, and nothing else, on stdout
    assert payload["schema"] == "detrace.locate/1" and payload["verdict"] == "error"
    message = payload["message"]
    assert "CMD exited with status 5 in run 2-module-a" in message
    assert "ran to completion at the semantic rung, so detrace's module rung made it fail" in message
    assert "fails on its own" not in message and "Traceback" not in printed.err
    assert f"detrace locate: error: {message}" in printed.err
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-module-a"]


def test_json_prints_the_locate_file_the_ladder_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert locate_cli.main(["--json", "--out", str(out), "--", "python", "train.py"],
                           launch=Scripted(second_arm=True)) == 1
    payload = json.loads(capsys.readouterr().out)  # one JSON object, and nothing else, on stdout
    assert payload == json.loads((out / LOCATE_FILE).read_text())
    assert list(payload) == ["schema", "verdict", "culprit", "replay", "runs", "report", "cost"]
    assert payload["verdict"] == "nondeterministic" and payload["culprit"]["name"] == "aten.add.Tensor"


def test_a_run_shorter_than_its_checkpoint_period_says_so(tmp_path: Path) -> None:
    """A script that follows the contract but whose run ends before --checkpoint-every steps takes no checkpoint:
    the note says that, not that CMD ignores the contract."""
    script = tmp_path / "train.py"
    script.write_text("import detrace\n")
    config = LocateConfig(command=("python", str(script)), out=tmp_path / "out", checkpoint_every=RUN.steps)
    result = locate(config, launch=Scripted(second_arm=True))
    assert result.cost is not None and result.cost.resume == "no-contract"
    assert result.notes[0].startswith(f"the run has {RUN.steps} steps, no more than --checkpoint-every {RUN.steps}, "
                                      "so it took no checkpoint")


def test_runs_that_stop_at_different_steps_are_nondeterministic_without_narrowing(tmp_path: Path) -> None:
    class StopsEarly(Scripted):
        """Run b closes its trace after step 2 of 4, every record before that equal: the program decided to stop."""

        def __call__(self, cmd: list[str], out: Path, *, rung: str, env: dict[str, str] | None = None,
                     **kwargs: object) -> LaunchResult:
            result = super().__call__(cmd, out, rung=rung, env=env, **kwargs)
            if Path(out).name.endswith("-b"):
                from _synthetic import write_table

                from detrace.tracefile import read_rank
                for rank in range(self.run.ranks):
                    table = read_rank(out, rank).table
                    (Path(out) / f"rank-{rank:05d}.arrow").unlink()
                    (Path(out) / f"rank-{rank:05d}.json").unlink()
                    write_table(out, rank, table.filter(table["step"].to_numpy() <= 2), world_size=self.run.ranks)
            return result

    launcher = StopsEarly()
    result = _locate(tmp_path, launcher)
    assert result.verdict == "nondeterministic" and result.culprit is None
    assert launcher.runs == ["1-semantic-a", "1-semantic-b"]  # no rung below reruns steps that all matched
    assert result.message.startswith("two runs of CMD do not cover the same steps: B stopped after global step 2 "
                                     "and A ran on to step 3")


def test_the_resume_proof_leaves_out_the_state_a_run_ended_with(tmp_path: Path) -> None:
    """locate's resume proof compares a run resumed after step 2 and stopped after step 3 with run A over step 3
    alone. The state the resumed run ended with (phase "final") carries step 3's number but is no record of step 3:
    it was taken for 157 records "with no partner" in run A, which ran on, and every checkpointed ladder fell back
    to full runs ("inexact")."""
    from _synthetic import TrainingStep, write_training_rank

    from detrace.analyze.pairs import same_over

    def run(name: str, steps: range, at_3: int = 13) -> Path:
        out = tmp_path / name
        trained = [TrainingStep(step=s, params={"w": at_3 if s == 3 else 10 + s}) for s in steps]
        trained[-1] = TrainingStep(step=steps[-1], params=trained[-1].params, final=trained[-1].params)
        write_training_rank(out, 0, trained, world_size=1)
        return out

    whole = run("a", range(6))
    assert same_over(whole, run("resumed", range(3, 4)), 3, 3) is None
    differs = same_over(whole, run("other", range(3, 4), at_3=99), 3, 3)
    assert differs == "rank 0, step 3: optimizer w#0 param[0] differs"
