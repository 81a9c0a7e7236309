"""check-resume --native decides in process: a launcher that acts as a script with its own checkpoints (it saves
`checkpoints/step-N.pt` every 2 steps, resumes from the latest one there, and logs both as the tracer would)
checks the clean slate each arm starts from, and the verdicts and refusals that come from CMD's own checkpoints.
The real tracer and a real script: tests/e2e/test_native_resume.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from _synthetic import Fault, SyntheticRun, write_run
from _tools import tree

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
                 saves: bool = True, folder: str = "checkpoints") -> None:
        self.faults = dict(faults or {})
        self.resumes, self.flag, self.saves, self.folder = resumes, flag, saves, folder
        self.seen: dict[str, list[str]] = {}
        self.commands: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}

    def __call__(self, cmd: list[str], out: Path, *, env: Mapping[str, str] | None = None, **_: object
                 ) -> LaunchResult:
        env = dict(env or {})
        folder = Path(self.folder)
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
                            "paths": [f"{self.folder}/step-{step}.pt"], "pid": 1, "control": None,
                            "rng": [["torch", ["rng", "cpu"]]]})
        out.mkdir(parents=True, exist_ok=True)
        write_run(out, RUN, self.faults.get(out.name))
        write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished",
                                                 "steps": {"first": 0, "last": RUN.steps - 1}})
        checkpoint_log_path(out, 1).write_text("".join(json.dumps(line) + "\n" for line in log))
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")


def _check(tmp_path: Path, launcher: OwnCheckpoints, *, resume_args: tuple[str, ...] = (), force: bool = False,
           at: int = 2, cmd: tuple[str, ...] = ("train",)) -> object:
    out = tmp_path / "out"
    contract = NativeContract(list(cmd), out=out, resume_args=resume_args, force=force, root=Path.cwd(), at=[at])
    return check_resume(list(cmd), at=[at], out=out, launch=launcher, contract=contract)


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
    with pytest.raises(CommandFailed, match=r"^CMD did not resume: its resumed run after step 2 loaded no checkpoint; "
                                            r"give --resume-args"):
        _check(tmp_path, OwnCheckpoints(resumes=False))
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["step-2.pt", "step-4.pt", "step-6.pt"]


def test_a_resumed_run_that_loads_another_file_and_records_nothing_is_one_sentence(tmp_path: Path,
                                                                                    work: Path) -> None:
    """The resumed arm loads a file the stopped run did not save (the user's weights.pt) and, with no optimizer
    count to number its steps from, records nothing after the stop step. Before: 'nothing was recorded ... the
    tracer starts in each Python process that imports torch', which blamed the tracer."""

    class WrongFile(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            if out.name != "resumed":
                return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]
            out.mkdir(parents=True)
            write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished"})
            checkpoint_log_path(out, 1).write_text(json.dumps(
                {"op": "load", "api": "torch.load", "completed": 0, "paths": ["weights.pt"], "pid": 1,
                 "control": None}) + "\n")
            return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")

    with pytest.raises(CommandFailed, match=(
            r"^CMD did not resume from its checkpoint: its resumed run after step 2 loaded weights\.pt, which the run "
            r"stopped after step 2 did not save \(it saved checkpoints/step-2\.pt\), and recorded no step after step "
            r"2; give --resume-args with the arguments that make it load checkpoints/step-2\.pt$")):
        _check(tmp_path, WrongFile())
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
    monkeypatch.setattr(check_resume_cli, "check_resume", lambda *a, **k: check_resume(*a, **{**k, "launch": launcher}))
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


# -- the user's files: every entry's bytes, name and place before and after the check ------------------------------


def _users_checkpoints(work: Path, folder: str = "checkpoints", *, when: float | None = None) -> None:
    """A checkpoint of the user's own (CMD resumes from it), and beside it what a checkpoint folder holds besides
    files: an empty folder, folders holding only folders, a link to a file and a link to a folder."""
    ckpt = work / folder
    ckpt.mkdir(parents=True)
    (ckpt / "step-4.pt").write_text("the user's own")
    (ckpt / "empty").mkdir()
    (ckpt / "nested" / "deeper").mkdir(parents=True)
    (ckpt / "latest").symlink_to("step-4.pt")
    (ckpt / "previous").symlink_to("nested")
    (work / "notes.txt").write_text("the user's notes")
    stamp = time.time() - 3600 if when is None else when
    os.utime(ckpt / "step-4.pt", (stamp, stamp))


class Interrupts(OwnCheckpoints):
    """CMD interrupted by `sig`, sent to this process while the arm `arm` runs, after it wrote a partial file in
    place of the user's checkpoint."""

    def __init__(self, sig: int, arm: str, **kwargs: object) -> None:
        super().__init__({"control-rng": FAULT}, **kwargs)  # type: ignore[arg-type]
        self.sig, self.arm = sig, arm

    def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
        if out.name == self.arm:
            Path(self.folder).mkdir(exist_ok=True)
            Path(self.folder, "step-4.pt").write_text("partial")
            os.kill(os.getpid(), self.sig)
        return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]


def _native(launcher: OwnCheckpoints, monkeypatch: pytest.MonkeyPatch, *options: str) -> int:
    monkeypatch.setattr(check_resume_cli, "check_resume", lambda *a, **k: check_resume(*a, **{**k, "launch": launcher}))
    return main(["check-resume", "--native", *options, "--", sys.executable, "train.py"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("arm", ["continuous-again", "resumed"])  # (the user's folder moved aside by then)
def test_a_signal_puts_every_file_back_and_exits_as_for_the_signal(
        sig: signal.Signals, arm: str, tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _users_checkpoints(work)
    before = tree(work)
    out = tmp_path / "out"
    assert _native(Interrupts(sig, arm), monkeypatch, "--force", "--at", "2", "--out", str(out)) == 128 + sig
    assert tree(work) == before  # the user's checkpoint, its folders and links, byte for byte and in place
    assert not (out / "before-check").exists() or not any((out / "before-check").iterdir())
    assert json.loads((out / "native-journal.json").read_text())["finished"]
    assert not (work / "detrace-runs").exists()  # the lock let go
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the handlers are the program's again
    if sig != signal.SIGINT:
        assert f"interrupted by {sig.name}; CMD's checkpoints are back where they were" in capsys.readouterr().err


def test_a_signal_while_files_move_waits_until_they_have_moved(tmp_path: Path, work: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _users_checkpoints(work)
    before = tree(work)
    move = shutil.move
    sent: list[str] = []

    def hung_up(source: str | Path, destination: str | Path) -> object:
        if f"{os.sep}at-2{os.sep}resumed{os.sep}" in str(destination) and not sent:  # its first file going aside
            sent.append(str(source))
            os.kill(os.getpid(), signal.SIGHUP)
        return move(source, destination)

    monkeypatch.setattr(shutil, "move", hung_up)
    out = tmp_path / "out"
    assert _native(OwnCheckpoints({"control-rng": FAULT}), monkeypatch, "--force", "--at", "2", "--out",
                   str(out)) == 128 + signal.SIGHUP
    assert sent and tree(work) == before
    assert sorted(p.name for p in (out / "saved-by-cmd" / "at-2" / "resumed" / "checkpoints").iterdir()) == [
        "step-2.pt", "step-4.pt", "step-6.pt"]  # every file of the arm went aside, not the first alone


def test_sigterm_passed_on_to_cmd_ends_the_check_as_sigterm(tmp_path: Path, work: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while CMD runs goes to CMD (the launcher passes it on): the run ends interrupted, and so does the
    check, with the files put back and SIGTERM's exit code."""
    _users_checkpoints(work)
    before = tree(work)

    class Terminated(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            done = super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]
            return dataclasses.replace(done, returncode=-15, interrupted=True) if out.name == "resumed" else done

    monkeypatch.setattr(check_resume_cli, "run_traced", Terminated({"control-rng": FAULT}))
    argv = ["check-resume", "--native", "--force", "--at", "2", "--out", str(tmp_path / "out"), "--", "train"]
    assert main(argv) == 128 + signal.SIGTERM
    assert tree(work) == before


class Killed(BaseException):
    """SIGKILL, as far as the check can tell: it stops where it is, and nothing of it runs after."""


@pytest.mark.parametrize("how", ["recover", "next-check"])
def test_a_killed_check_is_put_back_from_its_journal(how: str, tmp_path: Path, work: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _users_checkpoints(work)
    before = tree(work)

    class Kills(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            if out.name == "resumed":
                Path("checkpoints", "step-4.pt").write_text("partial")
                raise Killed
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    def dies(self: NativeContract) -> None:  # the process is gone: only the kernel lets go of its lock
        assert self._lock is not None
        os.close(self._lock)

    with monkeypatch.context() as killed:
        killed.setattr(NativeContract, "finish", dies)
        with pytest.raises(Killed):
            _native(Kills(), killed, "--force", "--at", "2", "--out", str(tmp_path / "killed"))
    assert (work / "checkpoints" / "step-4.pt").read_text() == "partial"  # the user's is in OUT
    journal = json.loads((tmp_path / "killed" / "native-journal.json").read_text())
    assert not journal["finished"] and journal["moved"] == [
        [str(work / "checkpoints"), str(tmp_path / "killed" / "before-check" / "checkpoints")]]
    if how == "recover":
        capsys.readouterr()
        main(["doctor"])  # (its exit code is the machine's settings')
        assert (f"a check-resume --native writing into {tmp_path / 'killed'} was killed before it put back the "
                f"checkpoints it had moved aside; run: detrace check-resume --recover {tmp_path / 'killed'}"
                ) in capsys.readouterr().out
        assert main(["check-resume", "--recover", str(tmp_path / "killed")]) == 0
        assert tree(work) == before
        main(["doctor"])
        assert "check-resume --native" not in capsys.readouterr().out
        assert main(["check-resume", "--recover", str(tmp_path / "killed")]) == 0  # once is enough
        assert "nothing to recover: the check-resume --native in" in capsys.readouterr().err
    else:  # the next check finds the journal through the lock file the killed one left, and puts back first
        assert _native(OwnCheckpoints({"control-rng": FAULT}), monkeypatch, "--force", "--at", "2", "--out",
                       str(tmp_path / "next")) == 0
        assert "put back what the check-resume --native in" in capsys.readouterr().err
        assert tree(work) == before
    assert (tmp_path / "killed" / "saved-by-cmd" / "unfinished-arm" / "checkpoints" / "step-4.pt").read_text() == (
        "partial")


def test_recover_refuses_a_folder_without_a_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-resume", "--recover", str(tmp_path)]) == 2
    assert "holds no readable journal of check-resume --native" in capsys.readouterr().err


def test_force_moves_the_checkpoint_folder_not_the_project_folder(tmp_path: Path, work: Path) -> None:
    (work / "proj").mkdir()
    (work / "proj" / "train.py").write_text("# the script")
    _users_checkpoints(work, "proj/ck")
    before = tree(work)

    class Script(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            assert Path("proj/train.py").is_file(), f"the script is gone in the {out.name} run"
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    launcher = Script({"control-rng": FAULT}, folder="proj/ck")
    result = _check(tmp_path, launcher, force=True, cmd=("python", "proj/train.py", "--ckpt-dir", "proj/ck"))
    assert result.verdict == "exact"  # type: ignore[attr-defined]
    assert launcher.seen["continuous"] == []
    assert tree(work) == before


def test_a_checkpoint_folder_linked_outside_the_working_directory(tmp_path: Path, work: Path) -> None:
    (tmp_path / "disk").mkdir()
    (work / "ck").symlink_to(tmp_path / "disk")
    launcher = OwnCheckpoints({"control-rng": FAULT}, folder="ck")
    assert _check(tmp_path, launcher).verdict == "exact"  # type: ignore[attr-defined]
    # each arm started from a clean slate: the second continuous run did not resume from the first one's files
    assert launcher.seen["continuous-again"] == [] and launcher.seen["resumed"] == ["step-2.pt"]
    assert (work / "ck").is_symlink()
    assert {p.name: p.read_text() for p in (tmp_path / "disk").iterdir()} == {
        f"step-{k}.pt": f"continuous {k}" for k in (2, 4, 6)}


def test_checkpoints_in_the_working_directory_move_alone(tmp_path: Path, work: Path) -> None:
    (work / "notes.txt").write_text("notes:")

    class Edits(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            with open("notes.txt", "a") as notes:  # the user edits their notes while the check runs
                notes.write(f" {out.name}")
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    assert _check(tmp_path, Edits({"control-rng": FAULT}, folder=".")).verdict == "exact"  # type: ignore[attr-defined]
    assert (work / "notes.txt").read_text() == (
        "notes: continuous continuous-again stopped resumed control-rng")  # every edit, never moved
    assert not list((tmp_path / "out").rglob("notes.txt"))
    assert sorted(p.name for p in work.glob("step-*.pt")) == ["step-2.pt", "step-4.pt", "step-6.pt"]


def test_a_checkpoint_from_the_future_is_still_the_users(tmp_path: Path, work: Path) -> None:
    _users_checkpoints(work, when=time.time() + 3600)  # its clock ahead of this one (a copy, another machine)
    before = tree(work)
    with pytest.raises(UsageError, match=r"^CMD's continuous run loaded checkpoints/step-4.pt, a checkpoint that "
                                         r"was there before the check"):
        _check(tmp_path, OwnCheckpoints())
    assert tree(work) == before
    assert not list((tmp_path / "out").rglob("step-4.pt"))


def test_out_in_the_scripts_checkpoint_folder_is_refused(tmp_path: Path, work: Path) -> None:
    launcher = OwnCheckpoints()
    contract = NativeContract(["train", "--ckpt-dir=checkpoints"], out=work / "checkpoints", root=work, at=[2])
    with pytest.raises(UsageError, match=r"^--out .*checkpoints is also named by CMD \(--ckpt-dir=checkpoints\): "):
        check_resume(["train"], at=[2], out=work / "checkpoints", launch=launcher, contract=contract)
    assert launcher.seen == {}  # refused before any run
    contract = NativeContract(["train"], out=work / "checkpoints", root=work, at=[2])
    with pytest.raises(UsageError, match=r"^--out .*checkpoints is where CMD keeps its checkpoints "
                                         r"\(checkpoints/step-2.pt\): .* give --out a folder of its own$"):
        check_resume(["train"], at=[2], out=work / "checkpoints", launch=launcher, contract=contract)
    assert list(launcher.seen) == ["continuous"]
    assert (work / "checkpoints" / "continuous" / "run.json").is_file()  # the check's own run, not moved


def test_two_checks_at_once_in_one_folder(tmp_path: Path, work: Path) -> None:
    refusals: list[str] = []

    class Second(OwnCheckpoints):
        def __call__(self, cmd: list[str], out: Path, **kwargs: object) -> LaunchResult:
            if out.name == "continuous" and not refusals:
                with pytest.raises(UsageError) as second:
                    _check(tmp_path / "second", OwnCheckpoints())
                refusals.append(str(second.value))
            return super().__call__(cmd, out, **kwargs)  # type: ignore[arg-type]

    assert _check(tmp_path, Second({"control-rng": FAULT})).verdict == "exact"  # type: ignore[attr-defined]
    assert refusals == [f"another detrace check-resume --native (pid {os.getpid()}, --out {tmp_path / 'out'}) is "
                        f"moving checkpoints in {work}; wait for it to end: two checks at once would take each "
                        "other's files for their own"]


def test_at_a_step_without_a_save_is_refused_after_the_first_run_and_resume_args_take_k(tmp_path: Path,
                                                                                       work: Path) -> None:
    launcher = OwnCheckpoints()
    with pytest.raises(UsageError, match=r"saved no checkpoint after step 3: its continuous run saved after steps "
                                         r"2, 4, 6; give --at one of them"):
        _check(tmp_path, launcher, at=3)
    assert list(launcher.seen) == ["continuous"]
    launcher = OwnCheckpoints({"control-rng": FAULT}, flag="--resume_from_checkpoint")
    result = _check(tmp_path / "k", launcher, at=4, resume_args=("--resume_from_checkpoint", "out/checkpoint-{K}"))
    assert result.verdict == "exact"  # type: ignore[attr-defined]
    assert launcher.commands["resumed"] == ["train", "--resume_from_checkpoint", "out/checkpoint-4"]
