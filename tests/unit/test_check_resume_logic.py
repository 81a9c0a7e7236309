"""check and check-resume decide their verdicts in process, on synthetic traces with known answers.

The launch seam (`launch=`) replaces the real launcher with `Scripted`, which writes, for each arm, the trace a
command with a given behaviour would have written: the four-arm proof's every verdict and message is checked here
in milliseconds; the README tour (tests/e2e/test_readme_tour.py) and the framework cases keep the real commands.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
from _synthetic import Fault, SyntheticRun, rank_table, write_run, write_table

from detrace.analyze import Divergence
from detrace.cli import check as check_cli
from detrace.cli import check_resume as check_resume_cli
from detrace.cli import main
from detrace.errors import CommandFailed, UsageError
from detrace.investigate.check import check
from detrace.investigate.check_resume import Contract, check_resume, compare_parts
from detrace.launch.launcher import LaunchResult
from detrace.report.meaning import forgotten
from detrace.tracefile.layout import checkpoint_log_path, run_header_path, state_parts_path
from detrace.tracefile.state_parts import RECORDED
from detrace.tracefile.writer import write_json_atomic

RUN = SyntheticRun(ranks=2, steps=4, ops=4)


class Scripted:
    """A launcher whose CMD behaves as told: `faults` maps an arm ("continuous", "again", "stopped", "resumed",
    "resumed-again", "control-rng", "control-data", "control-optimizer", "control-model") to the injected fault
    (named as such) its trace shows, None for the true bits."""

    def __init__(self, faults: Mapping[str, Fault | None] | None = None, *, checkpoint: bool = True,
                 records: bool = True) -> None:
        self.faults = dict(faults or {})
        self.checkpoint = checkpoint
        self.records = records  # False: a step window past the run's end, so no record at all
        self.arms: list[str] = []

    def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None, **_: object) -> LaunchResult:
        env = env or {}
        arm = out.name if out.name in ("stopped", "resumed", "resumed-again") or out.name.startswith("control-") \
            else "again" if out.name == "continuous-again" else out.name.split("-")[0]
        if arm.startswith("control-"):  # the control the arm's directory is named after is the one it ran
            assert env["DETRACE_RESUME_CONTROL"] == f"skip-{arm.removeprefix('control-')}"
        self.arms.append(arm)
        out.mkdir(parents=True, exist_ok=True)
        if self.records:
            write_run(out, RUN, self.faults.get(arm))
        # the run.json the launcher completes from the ranks' footers: check-resume reads the last step from it
        steps = {"steps": {"first": 0, "last": RUN.steps - 1}} if self.records else {}
        write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished", **steps})
        if "DETRACE_STOP_AT" in env and self.checkpoint:
            Path(env["DETRACE_CKPT_DIR"]).mkdir(parents=True)
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")


CONTROL = Fault(rank=0, step=2, op=0)  # resuming without a part of the state: differs from the first resumed step on
ALL = ["continuous", "again", "stopped", "resumed", "control-rng", "control-data", "control-optimizer",
       "control-model"]
RESUME_BUG = Fault(rank=1, step=2, op=1)


def _cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: Scripted, *args: str) -> list[str]:
    monkeypatch.setattr(check_resume_cli, "check_resume", functools.partial(check_resume, launch=launcher))
    return ["check-resume", "--out", str(tmp_path / "r"), *args, "--", sys.executable, "train.py"]


@pytest.mark.parametrize(
    ("faults", "verdict", "code", "arms"),
    [
        ({"control-rng": CONTROL}, "exact", 0, ["continuous", "again", "stopped", "resumed", "control-rng"]),
        ({"control-data": CONTROL, "control-optimizer": CONTROL}, "exact", 0, ALL[:6]),
        ({"control-model": CONTROL}, "exact", 0, ALL),
        ({"resumed": RESUME_BUG, "resumed-again": RESUME_BUG}, "resume-changed-the-run", 1,
         ["continuous", "again", "stopped", "resumed", "resumed-again"]),
        ({"again": CONTROL}, "nondeterministic", 3, ["continuous", "again"]),
        ({"resumed": RESUME_BUG, "resumed-again": Fault(rank=1, step=2, op=2)}, "nondeterministic", 3,
         ["continuous", "again", "stopped", "resumed", "resumed-again"]),
        ({}, "inconclusive", 4, ALL),
    ],
    ids=["exact", "exact-without-rng", "exact-by-the-model", "resume-bug", "nondeterministic",
         "unrepeatable-after-resume", "inconclusive"],
)
def test_every_verdict_of_the_four_arm_proof(tmp_path: Path, faults: dict[str, Fault], verdict: str, code: int,
                                            arms: list[str]) -> None:
    launcher = Scripted(faults)
    result = check_resume(["train"], at=[2], out=tmp_path / "r", launch=launcher)
    assert (result.verdict, result.exit_code) == (verdict, code)
    assert launcher.arms == arms  # no arm runs that the verdict does not need


def test_several_stop_points_share_the_continuous_runs(tmp_path: Path) -> None:
    launcher = Scripted({"control-rng": Fault(rank=0, step=1, op=0)})
    result = check_resume(["train"], at=[3, 1], out=tmp_path / "r", launch=launcher)
    assert result.verdict == "exact" and result.at == [1, 3]
    assert launcher.arms.count("continuous") == 1 and launcher.arms.count("resumed") == 2
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["at-1", "at-3", "continuous", "continuous-again"]


def test_the_first_stop_point_that_fails_decides(tmp_path: Path) -> None:
    # at-1 resumes exactly (its control diverges); at-3's resume repeats the same wrong bits: the run changed.
    class Late(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            self.faults = {"control-rng": CONTROL} if "at-1" in str(out) else {"resumed": RESUME_BUG,
                                                                           "resumed-again": RESUME_BUG}
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    result = check_resume(["train"], at=[1, 3], out=tmp_path / "r", launch=Late())
    assert [p.verdict for p in result.points] == ["exact", "resume-changed-the-run"]
    assert result.verdict == "resume-changed-the-run" and result.deciding.first is not None
    assert result.deciding.first.step == 2 and result.deciding.first.rank == 1


def test_a_stop_point_past_the_last_step_is_refused_after_one_run(tmp_path: Path) -> None:
    launcher = Scripted(records=False)
    with pytest.raises(UsageError, match=r"no step from 3 on .* stopping after 3 steps leaves no step to resume"):
        check_resume(["train"], at=[3], out=tmp_path / "past", launch=launcher)
    assert launcher.arms == ["continuous"]
    with pytest.raises(UsageError, match=r"the continuous run has 4 steps \(steps count from 0: its last is step 3\), "
                                         r"so stopping after 5 steps leaves no step to resume; give --at below 4$"):
        check_resume(["train"], at=[1, 5], out=tmp_path / "late", launch=Scripted())


def test_a_command_that_writes_no_checkpoint_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed, match=r"wrote no checkpoint .* when asked to stop after step 2"):
        check_resume(["train"], at=[2], out=tmp_path / "r", launch=Scripted(checkpoint=False))


@pytest.mark.parametrize(
    ("faults", "code", "start"),
    [
        ({"control-rng": CONTROL}, 0, "exact: two continuous runs agree, and resuming after step 2 changed no bit"),
        ({"resumed": RESUME_BUG, "resumed-again": RESUME_BUG}, 1,
         "resume-changed-the-run: resuming after step 2 changed the run"),
        ({"again": CONTROL}, 3, "nondeterministic: two continuous runs of the same command differ"),
        ({}, 4, "inconclusive: the run resumed after step 2 matched, but so did every negative control (skip-rng, "
                "skip-data, skip-optimizer, skip-model): after step 2 leaving out its RNG states, data position, "
                "optimizer state or model changed nothing, so"),
    ],
    ids=["exact", "resume-bug", "nondeterministic", "inconclusive"],
)
def test_the_command_says_each_verdict_in_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], faults: dict[str, Fault],
                                                code: int, start: str) -> None:
    assert main(_cli(tmp_path, monkeypatch, Scripted(faults), "--at", "2")) == code
    out = capsys.readouterr().out
    assert out.startswith(start), out
    if code == 3:
        assert f"find the culprit with: detrace locate -- {sys.executable} train.py" in out
    if code == 1:
        assert "first divergence: rank 1, step 2" in out


def test_the_json_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli(tmp_path, monkeypatch, Scripted({"control-rng": CONTROL}), "--at", "2", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "detrace.check-resume/1" and report["verdict"] == "exact" and report["at"] == [2]
    assert report["repeat"]["verdict"] == "identical" and report["repeat"]["compared"]["ranks"] == 2
    [point] = report["points"]
    assert point["resume"]["verdict"] == "identical" and point["control"]["verdict"] == "diverged"
    assert point["resumed_again"] is None and set(point["runs"]) == {"stopped", "resumed", "control_rng"}
    assert [c["control"] for c in point["controls"]] == ["skip-rng"] and point["controls"][0]["mattered"]
    assert point["untried"] == ["skip-data", "skip-optimizer", "skip-model"]
    assert report["first"]["step"] == 2 and report["suggest"] is None


def test_a_resumed_run_that_stops_early_changed_the_run(tmp_path: Path) -> None:
    """The resumed arms train a correct prefix and close their traces a step before the continuous run's last: every
    record they share is equal, and the verdict is resume-changed-the-run, never exact."""

    class StopsEarly(Scripted):
        def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None,
                     **kwargs: object) -> LaunchResult:
            result = super().__call__(cmd, out, env=env, **kwargs)
            if out.name in ("resumed", "resumed-again"):
                for rank in range(RUN.ranks):
                    table = rank_table(RUN, rank)
                    for path in (out / f"rank-{rank:05d}.arrow", out / f"rank-{rank:05d}.json"):
                        path.unlink()
                    steps = table["step"].to_numpy()
                    write_table(out, rank, table.filter((steps >= 1) & (steps <= 2)), world_size=RUN.ranks)
            return result

    result = check_resume([sys.executable, "train.py"], at=[1], out=tmp_path / "r", launch=StopsEarly())
    assert result.verdict == "resume-changed-the-run" and result.exit_code == 1
    first = result.deciding.first
    assert first is not None and first.stop is not None
    assert first.stop.startswith("B stopped after global step 2 and A ran on to step 3")


def test_check_compares_every_run_with_the_first(tmp_path: Path) -> None:
    class Third(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            write_run(out, RUN, Fault(rank=0, step=1, op=3) if out.name == "run-2" else None)
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    result = check(["train"], runs=3, out=tmp_path / "c", launch=Third())
    assert [d.verdict for d in result.diffs] == ["identical", "diverged"] and result.exit_code == 1
    first = result.first_divergent
    assert first is not None and first.first is not None and (first.first.rank, first.first.step) == (0, 1)


def test_the_check_command_says_identical_in_json_and_in_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    launcher = Scripted()
    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=launcher))
    argv = ["--", sys.executable, "train.py"]
    assert main(["check", "--out", str(tmp_path / "c"), "--json", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "detrace.check/1" and report["identical"] is True and len(report["runs"]) == 2
    assert report["diffs"][0]["verdict"] == "identical" and report["diffs"][0]["compared"]["records"] > 0
    assert main(["check", "--out", str(tmp_path / "words"), "--runs", "3", *argv]) == 0
    assert capsys.readouterr().out == f"identical: 3 runs are bit-identical ({tmp_path / 'words'})\n"
    assert len(launcher.arms) == 5


# A loop with optimizer steps but no TrainState: traced and repeatable, but it cannot stop and resume.
NO_CONTRACT = ("import torch; torch.manual_seed(0); m = torch.nn.Linear(2, 1)\n"
               "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
               "for _ in range(3): m(torch.ones(2)).sum().backward(); o.step()")


@pytest.mark.parametrize(("code", "launcher", "message"), [
    (NO_CONTRACT, Scripted(checkpoint=False),
     "wrote no checkpoint to {out}/at-1/checkpoint when asked to stop after step 1; does it use "
     "detrace.TrainState (resume_if_requested / end_of_step)"),
    ("import accelerate\n" + NO_CONTRACT, Scripted(checkpoint=False),
     "does it use detrace.integrations.accelerate.register(accelerator)"),
    ("pass", Scripted(records=False), "leaves no step to resume"),
], ids=["plain", "accelerate", "no-step"])
def test_a_command_without_the_contract_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], code: str,
                                                        launcher: Scripted, message: str) -> None:
    """The message names the integration that fits what the script imports (tests/unit/test_advice.py has the
    rules): a script that writes no checkpoint when asked to stop, or that records no step at all."""
    script = tmp_path / "train.py"
    script.write_text(code)
    out = tmp_path / "o"
    monkeypatch.setattr(check_resume_cli, "check_resume", functools.partial(check_resume, launch=launcher))
    assert main(["check-resume", "--at", "1", "--out", str(out), "--", sys.executable, str(script)]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the progress lines of the runs made
    assert last.startswith("detrace check-resume: error: ") and message.format(out=out) in last
    assert "Traceback" not in err


@pytest.mark.parametrize(("faults", "every", "says"), [
    # A loop that draws no random number after the stop (no dropout, a seeded sampler): proven by its data.
    ({"control-data": CONTROL, "control-optimizer": CONTROL, "control-model": CONTROL}, False,
     "after step 2 this run depends on its data position, not on its RNG states (not tried: its optimizer state "
     "and model; --every-control tries each part)"),
    ({"control-data": CONTROL, "control-optimizer": CONTROL, "control-model": CONTROL}, True,
     "after step 2 this run depends on its data position, optimizer state and model, not on its RNG states"),
    ({"control-rng": CONTROL, "control-model": CONTROL}, True,
     "after step 2 this run depends on its RNG states and model, not on its data position or optimizer state"),
], ids=["first-that-diverges", "every-control", "rng-and-model"])
def test_the_controls_say_which_parts_the_run_depends_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], faults: dict[str, Fault],
                                                        every: bool, says: str) -> None:
    """Each negative control leaves one part of the state out: a correct resume is `exact` when any part matters,
    and the verdict names the parts that did (issue 35, item 7)."""
    launcher = Scripted(faults)
    argv = _cli(tmp_path, monkeypatch, launcher, "--at", "2", *(["--every-control"] if every else []))
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    control = "skip-rng" if "control-rng" in faults else "skip-data"
    assert lines[0].startswith(f"exact: two continuous runs agree, and resuming after step 2 changed no bit; the "
                               f"negative control ({control}) diverged as it must, first divergence: rank 0, step 2")
    assert lines[1] == says


def test_a_framework_that_restores_the_model_is_not_given_the_model_control(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import lightning\n")
    launcher = Scripted()
    result = check_resume([sys.executable, str(script)], at=[2], out=tmp_path / "r", launch=launcher)
    assert result.verdict == "inconclusive" and launcher.arms[-1] == "control-optimizer"
    assert result.points[0].dependence == ("after step 2 leaving out its RNG states, data position or optimizer "
                                           "state changed nothing")


def test_the_check_command_says_what_to_run_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    class Second(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            write_run(out, RUN, Fault(rank=0, step=1, op=3) if out.name == "run-1" else None)
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=Second()))
    assert main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, "train.py"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run 2 differs from run 1 ({tmp_path / 'c'}):"
    assert lines[-1] == f"find the culprit with: detrace locate -- {sys.executable} train.py"


def test_check_refuses_runs_of_a_script_that_resumed_by_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Run 2 of a script that loads the latest checkpoint in its output directory (torchtitan-style auto-resume)
    starts where run 1 ended: one sentence naming the directory run 1 left, exit 2, never "run 2 differs"."""
    monkeypatch.chdir(tmp_path)

    class AutoResume(Scripted):
        def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None,
                     **kwargs: object) -> LaunchResult:
            assert env is not None and env["DETRACE_CKPT_DIR"] == str(out.parent / "checkpoints" / out.name)
            resumed = (tmp_path / "outputs").exists()
            (tmp_path / "outputs").mkdir(exist_ok=True)
            write_run(out, RUN)
            write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished",
                                                     "steps": {"first": 3 if resumed else 0, "last": 3}})
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=AutoResume()))
    assert main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("detrace check: error: run 2 started at global step 3 and run 1 at step 0: CMD resumed by "
                          "itself from a checkpoint that an earlier run left (the working directory's ")
    assert f"{tmp_path / 'outputs'} changed during the runs)" in err and "give each run a clean output" in err


def test_check_refuses_runs_of_which_one_loaded_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A torchtitan-style script that loads the newest DCP checkpoint under its own outputs/ when there is one: run 2
    loaded what run 1 saved, at the same global step (a DCP load of Stateful objects carries no step count), so the
    traces differ from the input batch on. One sentence naming the folder, exit 2, never "run 2 differs"."""
    monkeypatch.chdir(tmp_path)

    class DcpAutoResume(Scripted):
        def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None,
                     **kwargs: object) -> LaunchResult:
            root = tmp_path / "outputs" / "checkpoint"
            saved = sorted(root.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
            write_run(out, RUN, Fault(rank=0, step=0, op=0) if saved else None)
            newest = int(saved[-1].name.split("-")[1]) if saved else 0
            if saved:
                io = {"op": "load", "api": "dcp.load", "completed": 0, "paths": [f"outputs/checkpoint/step-{newest}"],
                      "pid": 7}
                checkpoint_log_path(out, 7).write_text(json.dumps(io) + "\n")
            (root / f"step-{newest + 4}").mkdir(parents=True)
            write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished",
                                                     "steps": {"first": 0, "last": 3}})
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=DcpAutoResume()))
    assert main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("detrace check: error: run 2 loaded a checkpoint from outputs/checkpoint/step-4 and run 1 "
                          "loaded none: CMD resumes by itself from a checkpoint that an earlier run left in "
                          "outputs/checkpoint, so the runs did not start from the same state; give each run a clean "
                          "one: delete outputs/checkpoint before `detrace check`")
    # A checkpoint left before the check: both runs load, each another one
    assert main(["check", "--out", str(tmp_path / "d"), "--", sys.executable, "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("detrace check: error: run 2 loaded a checkpoint from outputs/checkpoint/step-12 and run 1 "
                          "loaded outputs/checkpoint/step-8: CMD resumes by itself")


def test_an_integrations_warning_is_repeated_next_to_the_divergence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import detrace
    from detrace.launch.launcher import _warnings

    said = "detrace's Lightning integration leaves this run alone (no resume, no data seeding): a strategy"
    with detrace.trace(tmp_path / "t"):  # the tracer keeps the sentence in the rank's footer, for run.json
        detrace.record.warned(said)
        detrace.record.warned(said)
        detrace.metric("loss", 1.0)
    assert _warnings(tmp_path / "t", [0]) == [said]

    class Warned(Scripted):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            write_run(out, RUN, Fault(rank=0, step=1, op=3) if out.name == "run-1" else None)
            write_json_atomic(run_header_path(out), {"command": list(cmd), "warnings": [said]})
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=Warned()))
    assert main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, "train.py"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"the run warned: {said}",
                          f"find the culprit with: detrace locate -- {sys.executable} train.py"]


def test_exact_and_identical_say_what_was_compared_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation after step 3 in every arm (the continuous run's after step 2 too, before the compared steps)."""
    import pyarrow as pa
    from _synthetic import write_table

    from detrace.tracefile import ARROW_SCHEMA, read_rank
    from detrace.tracefile.layout import footer_path, rank_path

    class Evaluating(Scripted):
        def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None,
                     **kwargs: object) -> LaunchResult:
            result = super().__call__(cmd, out, env=env)
            for rank in range(RUN.ranks):
                rows = read_rank(out, rank).table.to_pylist()
                last = max(i for i, row in enumerate(rows) if row["step"] == 3)
                evaluation = {**rows[last], "phase": "evaluation", "rung": "semantic", "module": None, "name": "batch",
                              "occurrence": 0, "role": "output", "index": 0, "digest": 7, "value": None}
                rows = [{**row, "seq": i, "event": i} for i, row in enumerate([*rows, evaluation])]
                rank_path(out, rank).unlink()
                footer_path(out, rank).unlink()
                write_table(out, rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=RUN.ranks)
            return result

    launcher = Evaluating({"control-rng": CONTROL})
    assert main(_cli(tmp_path, monkeypatch, launcher, "--at", "2")) == 0
    assert ("note: after step 2, compared apart from the training, by identity: evaluations: 2 records in A, 2 in B, "
            "2 in both, every bit equal") in capsys.readouterr().out.splitlines()
    monkeypatch.setattr(check_cli, "check", functools.partial(check, launch=launcher))
    assert main(["check", "--out", str(tmp_path / "c"), "--", sys.executable, "train.py"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("note: compared apart from the training, by identity: "
                                                        "evaluations: 2 records in A, 2 in B, 2 in both, every bit "
                                                        "equal")


class WithState(Scripted):
    """Scripted, and each arm digests its state at the steps of DETRACE_STATE_AT as the tracer would: the same
    digests in every arm, but for the parts `differs` gives that arm (rank 1's), and Python's RNG state, which
    each process has its own of (never seeded)."""

    def __init__(self, faults: Mapping[str, Fault | None], differs: Mapping[str, dict[str, str | None]]) -> None:
        super().__init__(faults)
        self.differs = differs
        self.state_at: dict[str, str] = {}

    def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None, **kw: object
                 ) -> LaunchResult:
        env = env or {}
        done = super().__call__(cmd, out, env=env, **kw)
        self.state_at[out.name] = env["DETRACE_STATE_AT"]
        lines = []
        for step in filter(None, env["DETRACE_STATE_AT"].split(",")):
            for rank in range(RUN.ranks):
                parts: dict[str, str | None] = {part: "same" for part in RECORDED}
                parts |= {"CUDA RNG states": None, "Python RNG state": f"{out.name}"}
                if rank == 1:
                    parts |= self.differs.get(self.arms[-1], {})
                shown = {"param groups": "lr 0.5, weight decay 0.0",
                         "scheduler": f"LambdaLR at its step {0 if parts['scheduler'] != 'same' else step}"}
                lines.append(json.dumps({"step": int(step), "rank": rank, "optimizer": 0, "parts": parts,
                                         "shown": shown}))
        state_parts_path(out, 7).write_text("".join(line + "\n" for line in lines))
        return done


def test_the_restored_state_is_compared_part_by_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    forgot = {"scheduler": "another"}
    launcher = WithState({"resumed": RESUME_BUG, "resumed-again": RESUME_BUG},
                         {"resumed": forgot, "resumed-again": forgot})
    assert main(_cli(tmp_path, monkeypatch, launcher, "--at", "2")) == 1
    out = capsys.readouterr().out
    assert "what the resume forgot: the learning-rate scheduler is not where the continuous run's was: does your " \
           "checkpoint save the scheduler?" in out
    assert ("restored after step 2, before the resumed run's first update, against the continuous run's state at "
            "that point: equal: parameters, optimizer state, param groups, torch RNG state, NumPy RNG state, data "
            "position\n  differs: scheduler (resumed: LambdaLR at its step 0; continuous: LambdaLR at its step 2) on "
            "rank 1\n  not compared: Python RNG state (the two continuous runs differ in it already") in out
    # the continuous runs digest their state at every stop point, the resumed ones at theirs, the others never
    assert launcher.state_at == {"continuous": "2", "continuous-again": "2", "stopped": "", "resumed": "2",
                                 "resumed-again": "2"}


def test_an_exact_resume_shows_every_part_equal_and_the_data_position_comes_from_the_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    launcher = WithState({"control-rng": CONTROL}, {})
    assert main(_cli(tmp_path, monkeypatch, launcher, "--at", "2", "--json")) == 0
    [point] = json.loads(capsys.readouterr().out)["points"]
    assert [(c["part"], c["equal"]) for c in point["restored"]] == [
        ("parameters", True), ("optimizer state", True), ("param groups", True), ("scheduler", True),
        ("torch RNG state", True), ("Python RNG state", None), ("NumPy RNG state", True), ("data position", True)]
    # a resumed run whose first batch differs on rank 1: the data position is the trace's input batch of that step
    runs = tmp_path / "r"
    batch = Divergence(rank=1, step=2, seq=0, rung="semantic", phase="data", kind="numeric", name="batch",
                       module=None, role="input", origin=True)
    later = dataclasses.replace(batch, rank=0, step=3, phase="forward")
    diverged = SimpleNamespace(ranks=[SimpleNamespace(rank=0, first=later), SimpleNamespace(rank=1, first=batch)])
    compared = compare_parts(runs / "continuous", runs / "continuous-again", runs / "at-2" / "resumed", 2,
                             diverged)  # type: ignore[arg-type]
    assert [(c.part, c.equal, c.where) for c in compared][-1] == ("data position", False, ("rank 1",))
    said = forgotten(None, [c.part for c in compared if c.equal is False])
    assert said is not None and said.startswith("the data order or position is not the continuous run's")
    assert compare_parts(runs / "continuous", runs / "continuous-again", runs / "nothing", 2, diverged) == ()  # type: ignore[arg-type]


def test_a_resume_whose_every_part_is_equal_names_the_state_kept_outside(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # An EMA copy kept beside the model: the model, the optimizer, the RNG states and the batch all restored, the
    # backward still differs at the first resumed step.
    launcher = WithState({"resumed": RESUME_BUG, "resumed-again": RESUME_BUG}, {})
    assert main(_cli(tmp_path, monkeypatch, launcher, "--at", "2")) == 1
    out = capsys.readouterr().out
    [forgot] = [line for line in out.splitlines() if line.startswith("what the resume forgot")]
    assert forgot.startswith("what the resume forgot: the parts detrace compares (the model's parameters, the "
                             "optimizer, the RNG states, the data position) do not explain it: the script keeps "
                             "state outside the model and the optimizer")
    assert "RNG state (a dropout mask" not in forgot
    # the first divergence is at the stop point: what came before it was never compared
    assert "  steps before 2 were not compared: the resumed run starts there" in out.splitlines()


def test_two_continuous_runs_that_part_at_the_first_recorded_step_may_part_earlier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli(tmp_path, monkeypatch, Scripted({"again": Fault(rank=0, step=2, op=0)}), "--at", "2")) == 3
    assert ("  steps before 2 were not compared: the check's runs record from step 2, where the first resumed run "
            "starts, so the two runs may part earlier") in capsys.readouterr().out.splitlines()
    assert main(_cli(tmp_path / "later", monkeypatch, Scripted({"again": Fault(rank=0, step=3, op=0)}),
                     "--at", "2")) == 3
    assert "were not compared" not in capsys.readouterr().out  # steps 2 on were compared, and agreed up to 3


def _point(at: int, verdict: str, first: Divergence | None, **equal: bool) -> object:
    from detrace.analyze import DiffResult
    from detrace.investigate.check_resume import PartCompared, StopPoint

    restored = tuple(PartCompared(part=part.replace("_", " "), equal=value) for part, value in equal.items())
    diff = DiffResult(verdict="identical" if first is None else "diverged", first=first)
    return StopPoint(at=at, verdict=verdict, stopped=Path("s"), resumed=Path("r"),  # type: ignore[arg-type]
                     resume_diff=diff, restored=restored)


def test_an_rng_difference_that_an_exact_stop_point_shows_harmless_is_not_named() -> None:
    from detrace.investigate.check_resume import ResumeResult

    forward = Divergence(rank=0, step=4, seq=0, rung="semantic", phase="forward", kind="numeric", name="mm",
                         module=None, role="output", origin=True)
    parts = {"parameters": True, "optimizer_state": True, "data_position": True}
    exact = _point(2, "exact", None, **parts, **{"torch RNG state": False})
    changed = _point(4, "resume-changed-the-run", forward, **parts, **{"torch RNG state": False})
    result = ResumeResult(at=[2, 4], continuous=Path("c"), again=Path("a"), repeat_diff=exact.resume_diff,  # type: ignore[attr-defined]
                          points=[exact, changed])  # type: ignore[list-item]
    assert result.harmless == {"torch RNG state"}
    said = check_resume_cli._forgot(result, changed)  # type: ignore[arg-type]
    assert said is not None and said.startswith("the parts detrace compares") and "does your checkpoint save and " \
        "restore the RNG" not in said
    alone = ResumeResult(at=[4], continuous=Path("c"), again=Path("a"), repeat_diff=exact.resume_diff,  # type: ignore[attr-defined]
                         points=[changed])  # type: ignore[list-item]
    said = check_resume_cli._forgot(alone, changed)  # type: ignore[arg-type]
    assert said is not None and said.startswith("the RNG state is not the continuous run's")  # nothing says harmless


@pytest.mark.parametrize(("first", "equal", "words"), [
    ("forward", ["parameters", "torch RNG state"], "the parts detrace compares"),
    ("backward", [], "the RNG state (a dropout mask, an augmentation), or the model"),  # nothing compared
    ("optimizer", ["optimizer state", "param groups"], "the parts detrace compares"),
    ("final", ["parameters", "optimizer state"], "the parts detrace compares"),  # an EMA saved at the end
    ("evaluation", ["parameters", "optimizer state"], "the parts detrace compares"),  # an EMA evaluated
    ("data", ["data position"], "the same samples arrived, but their random augmentation"),
    ("data", ["parameters"], "the data order or position is not the continuous run's"),
])
def test_what_is_left_when_the_compared_parts_are_equal(first: str, equal: list[str], words: str) -> None:
    divergence = Divergence(rank=0, step=2, seq=0, rung="semantic", phase=first, kind="numeric",  # type: ignore[arg-type]
                            name="x", module=None, role="output", origin=True)
    said = forgotten(divergence, (), equal)
    assert said is not None and said.startswith(words)


class ResumeArgs(Contract):
    """The native contract's commands (CMD's own checkpoints): the resumed arms and the controls run CMD with
    --resume appended, as `--resume-args=--resume` does."""

    def resume(self, point: Path, control: str | None = None) -> tuple[list[str], dict[str, str]]:
        command, env = super().resume(point, control)
        return [*command, "--resume"], env


class SavesEma(WithState):
    """WithState, and every arm saves an EMA copy as its trace closes (a final-state record, "ema.pt"): the
    resumed arms' EMA restarted from the loaded weights (INJECTED FAULT: its bits differ), every step equal."""

    def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None, **kw: object
                 ) -> LaunchResult:
        import pyarrow as pa

        from detrace.tracefile import ARROW_SCHEMA, read_rank
        from detrace.tracefile.layout import footer_path, rank_path

        done = super().__call__(cmd, out, env=env, **kw)
        for rank in range(RUN.ranks):
            rows = read_rank(out, rank).table.to_pylist()
            last = max(i for i, row in enumerate(rows) if row["step"] == RUN.steps - 1)
            ema = {**rows[last], "phase": "final", "rung": "semantic", "module": None, "name": "ema.pt:0.weight",
                   "occurrence": 0, "role": "saved", "index": 0, "value": None,
                   "digest": 8 if out.name.startswith("resumed") else 7}
            rows = [{**row, "seq": i, "event": i} for i, row in enumerate([*rows, ema])]
            rank_path(out, rank).unlink()
            footer_path(out, rank).unlink()
            write_table(out, rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=RUN.ranks)
        return done


def test_a_native_resume_that_forgot_the_ema_it_saves_says_so(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """examples/loops/ema_forgotten.py under `check-resume --native --resume-args=--resume`: the resumed arm's extra
    argument is the check's own, not a cause; and the EMA saved at the end differs although every restored part
    compared equal, which is state outside the model and the optimizer, not "an unseeded draw after the training"."""
    cmd = [sys.executable, "train.py"]
    result = check_resume(cmd, at=[2], out=tmp_path / "r", launch=SavesEma({}, {}), contract=ResumeArgs(cmd))
    assert result.verdict == "resume-changed-the-run"
    [point] = result.points
    assert point.resume_diff.first is not None and point.resume_diff.first.phase == "final"
    check_resume_cli._summary(result, cmd)
    out = capsys.readouterr().out
    assert "different commands" not in out and "unseeded draw" not in out
    assert ("  every step matched, and the state the run ended with differs although every restored part compared "
            "equal: see what the resume forgot, below") in out.splitlines()
    [forgot] = [line for line in out.splitlines() if line.startswith("what the resume forgot")]
    assert forgot.startswith("what the resume forgot: the parts detrace compares (the model's parameters, the "
                             "optimizer, the RNG states, the data position) do not explain it: the script keeps "
                             "state outside the model and the optimizer")
    # `detrace diff` of the same two runs, which are of different commands, still says so, and keeps its hint
    from detrace.analyze import diff
    from detrace.report.terminal import diff_lines

    lines = diff_lines(diff(result.continuous, point.resumed))
    assert any(line.startswith("the runs are of different commands: ") for line in lines)
    assert any("an unseeded draw" in line for line in lines)
