"""check-resume --native decides in process: a launcher that acts as a script with its own checkpoints (it saves
`checkpoints/step-N.pt` every 2 steps, resumes from the latest one there, and logs both as the tracer would)
checks the clean slate each arm starts from, and the verdicts and refusals that come from CMD's own checkpoints.
The real tracer and a real script: tests/e2e/test_native_resume.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from _synthetic import Fault, SyntheticRun, write_run

from detrace.analyze import Divergence
from detrace.cli import check_resume as check_resume_cli
from detrace.cli import main
from detrace.errors import CommandFailed, UsageError
from detrace.investigate.check_resume import check_resume
from detrace.investigate.native_resume import NativeContract
from detrace.launch.launcher import LaunchResult
from detrace.report.meaning import forgotten
from detrace.state.contract import ENV_NATIVE_CONTROL as CONTROL_VAR
from detrace.state.contract import ENV_NATIVE_STOP_AT as STOP_VAR
from detrace.tracefile.layout import checkpoint_log_path, run_header_path
from detrace.tracefile.writer import write_json_atomic

RUN = SyntheticRun(ranks=1, steps=6, ops=2)
FAULT = Fault(rank=0, step=4, op=0)


class OwnCheckpoints:
    """CMD with checkpoints of its own, in the working directory: run to RUN.steps (or stopped at STOP_VAR), saving
    checkpoints/step-N.pt after every second step, resuming from the latest there unless `resumes` is False (or
    only with `flag` in its arguments). `faults` maps an arm's directory name to the fault its trace shows.
    `seen` keeps, per arm, the checkpoints it found when it started."""

    def __init__(self, faults: Mapping[str, Fault] | None = None, *, resumes: bool = True, flag: str | None = None,
                 saves: bool = True) -> None:
        self.faults = dict(faults or {})
        self.resumes, self.flag, self.saves = resumes, flag, saves
        self.seen: dict[str, list[str]] = {}
        self.commands: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}

    def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None, **_: object
                 ) -> LaunchResult:
        env = dict(env or {})
        folder = Path("checkpoints")
        found = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1])) if folder.is_dir() else []
        self.seen[out.name] = [p.name for p in found]
        self.commands[out.name] = list(cmd)
        self.envs[out.name] = env
        log: list[dict[str, object]] = []
        start = 0
        if found and self.resumes and (self.flag is None or self.flag in cmd):
            start = int(found[-1].stem.split("-")[1])
            log.append({"op": "load", "api": "torch.load", "completed": 0, "paths": [str(found[-1])],
                        "pid": 1, "control": env.get(CONTROL_VAR)})
        stop = int(env.get(STOP_VAR, RUN.steps))
        for step in range(start + 1, min(stop, RUN.steps) + 1):
            if step % 2 == 0 and self.saves:
                folder.mkdir(exist_ok=True)
                (folder / f"step-{step}.pt").write_text(f"{out.name} {step}")
                log.append({"op": "save", "api": "torch.save", "completed": step,
                            "paths": [f"checkpoints/step-{step}.pt"], "pid": 1, "control": None,
                            "rng": [["torch", ["rng", "cpu"]]]})
        out.mkdir(parents=True, exist_ok=True)
        write_run(out, RUN, self.faults.get(out.name))
        write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished",
                                                 "steps": {"first": 0, "last": RUN.steps - 1}})
        checkpoint_log_path(out, 1).write_text("".join(json.dumps(line) + "\n" for line in log))
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")


def _check(tmp_path: Path, launcher: OwnCheckpoints, *, resume_args: tuple[str, ...] = (), force: bool = False,
           at: int = 2) -> object:
    out = tmp_path / "out"
    contract = NativeContract(["train"], out=out, resume_args=resume_args, force=force, root=Path.cwd())
    return check_resume(["train"], at=[at], out=out, launch=launcher, contract=contract)


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def test_every_arm_starts_from_a_clean_slate_and_the_continuous_files_come_back(tmp_path: Path, work: Path) -> None:
    launcher = OwnCheckpoints({"control-rng": FAULT})
    result = _check(tmp_path, launcher)
    assert result.verdict == "exact"  # type: ignore[attr-defined]
    # the continuous runs found nothing; each resumed run found the stopped run's checkpoint, and only it
    assert launcher.seen == {"continuous": [], "continuous-again": [], "stopped": [], "resumed": ["step-2.pt"],
                             "control-rng": ["step-2.pt"]}
    # the first continuous run's files are back; every other arm's are in OUT, none deleted
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["step-2.pt", "step-4.pt", "step-6.pt"]
    assert (work / "checkpoints" / "step-4.pt").read_text() == "continuous 4"
    aside = tmp_path / "out" / "saved-by-cmd"
    assert (aside / "continuous-again" / "checkpoints" / "step-6.pt").read_text() == "continuous-again 6"
    assert (aside / "at-2" / "stopped" / "checkpoints" / "step-2.pt").read_text() == "stopped 2"
    assert (aside / "at-2" / "resumed" / "checkpoints" / "step-4.pt").read_text() == "resumed 4"
    assert result.points[0].controls[0].applied  # type: ignore[attr-defined]
    # skip-rng is told where the stopped run's save put its RNG states, per file
    assert json.loads(launcher.envs["control-rng"]["DETRACE_NATIVE_RNG"]) == {
        str(work / "checkpoints" / "step-2.pt"): [["torch", ["rng", "cpu"]]]}
    assert "DETRACE_NATIVE_RNG" not in launcher.envs["resumed"]


def test_only_the_checkpoint_folders_are_looked_into(tmp_path: Path, work: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The slate is kept in the folders the saves and loads named: the rest of the working directory (a log the
    command writes, a data folder) is neither walked nor moved."""
    (work / "data" / "deep").mkdir(parents=True)
    walked: list[str] = []
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: walked.append(str(top)) or walk(top, *a, **k))

    class Logs(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            Path("train.log").write_text(out.name)
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    assert _check(tmp_path, Logs({"control-rng": FAULT})).verdict == "exact"  # type: ignore[attr-defined]
    assert (work / "train.log").read_text() == "control-rng"  # the last arm's, never moved
    assert set(walked) == {str(work / "checkpoints")}


def test_a_command_that_does_not_resume_by_itself_is_one_sentence(tmp_path: Path, work: Path) -> None:
    with pytest.raises(CommandFailed, match=r"^CMD did not resume: its resumed run after at-2 loaded no checkpoint; "
                                            r"give --resume-args"):
        _check(tmp_path, OwnCheckpoints(resumes=False))
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["step-2.pt", "step-4.pt", "step-6.pt"]


def test_an_arm_that_fails_leaves_no_file_behind(tmp_path: Path, work: Path) -> None:
    class Crashes(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            done = super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]
            return dataclasses.replace(done, returncode=1) if out.name == "resumed" else done

    with pytest.raises(CommandFailed, match="run resumed after step 2 exited with code 1"):
        _check(tmp_path, Crashes())
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["step-2.pt", "step-4.pt", "step-6.pt"]
    assert (work / "checkpoints" / "step-6.pt").read_text() == "continuous 6"  # not the failed arm's
    assert (tmp_path / "out" / "saved-by-cmd" / "unfinished-arm" / "checkpoints" / "step-6.pt").read_text() == (
        "resumed 6")


def test_resume_args_are_appended_to_the_resumed_runs_only(tmp_path: Path, work: Path) -> None:
    launcher = OwnCheckpoints({"control-rng": FAULT}, flag="--init_from=resume")
    assert _check(tmp_path, launcher, resume_args=("--init_from=resume",)).verdict == "exact"  # type: ignore[attr-defined]
    assert launcher.commands["continuous"] == ["train"] and launcher.commands["stopped"] == ["train"]
    assert launcher.commands["resumed"] == launcher.commands["control-rng"] == ["train", "--init_from=resume"]


def test_a_checkpoint_there_before_the_check_is_refused_or_moved_aside_and_put_back(tmp_path: Path,
                                                                                    work: Path) -> None:
    (work / "checkpoints").mkdir()
    (work / "checkpoints" / "step-4.pt").write_text("the user's own")
    os.utime(work / "checkpoints" / "step-4.pt", (time.time() - 3600,) * 2)  # saved before the check
    with pytest.raises(UsageError, match=r"^CMD's continuous run loaded checkpoints/step-4.pt, a checkpoint that "
                                         r"was there before the check, .* give --force"):
        _check(tmp_path / "refused", OwnCheckpoints())
    launcher = OwnCheckpoints({"control-rng": FAULT})
    assert _check(tmp_path, launcher, force=True).verdict == "exact"  # type: ignore[attr-defined]
    assert launcher.seen["continuous"] == []  # the run that resumed from it was run again, without it
    assert [p.name for p in (work / "checkpoints").iterdir()] == ["step-4.pt"]
    assert (work / "checkpoints" / "step-4.pt").read_text() == "the user's own"
    assert (tmp_path / "out" / "saved-by-cmd" / "continuous" / "checkpoints" / "step-4.pt").exists()


def test_a_stop_point_where_cmd_saves_nothing_names_its_save_steps(tmp_path: Path, work: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"saved no checkpoint after step 3: its continuous run saved after steps "
                                         r"2, 4, 6; give --at one of them"):
        _check(tmp_path, OwnCheckpoints(), at=3)
    assert (work / "checkpoints" / "step-6.pt").read_text() == "continuous 6"  # put back after the error too
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(CommandFailed, match=r"CMD saved no checkpoint \(torch.save, safetensors or "):
        _check(tmp_path / "none", OwnCheckpoints(saves=False))


def test_a_resume_that_forgot_a_part_is_named_in_the_users_words(tmp_path: Path, work: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    launcher = OwnCheckpoints({"resumed": FAULT, "resumed-again": FAULT})
    monkeypatch.setattr(check_resume_cli, "check_resume", lambda *a, **k: check_resume(*a, **k, launch=launcher))
    argv = ["check-resume", "--native", "--at", "2", "--out", str(tmp_path / "out"), "--", sys.executable, "t.py"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith("resume-changed-the-run: resuming after step 2 changed the run")
    assert "what the resume forgot: the RNG state (a dropout mask, an augmentation), or the model" in out
    assert main(["check-resume", "--at", "2", "--force", "--", "train"]) == 2
    assert "--resume-args and --force go with --native" in capsys.readouterr().err


def _divergence(phase: str, *, origin: bool = True, kind: str = "numeric") -> Divergence:
    return Divergence(rank=0, step=5, seq=0, rung="semantic", phase=phase, kind=kind,  # type: ignore[arg-type]
                      name="0.weight", module=None, role="param", origin=origin)


@pytest.mark.parametrize(("first", "words"), [
    (_divergence("optimizer"), "the learning rate or optimizer state is not the one the continuous run had"),
    (_divergence("optimizer", origin=False), None),  # its gradients differed already: not the optimizer's fault
    (_divergence("data"), "the data order or position is not the continuous run's"),
    (_divergence("forward"), "the RNG state (a dropout mask, an augmentation), or the model"),
    (_divergence("optimizer", kind="structural"), None),
], ids=["optimizer", "optimizer-fed-other-gradients", "data", "forward", "structural"])
def test_what_the_resume_forgot(first: Divergence, words: str | None) -> None:
    said = forgotten(first)
    assert said == words if words is None else said is not None and said.startswith(words)
    if first.phase == "optimizer" and words is not None:
        assert said is not None and "does your checkpoint save the scheduler" in said
