"""End to end: `detrace check-resume --native` on a loop that checkpoints by itself with `torch.save`
(examples/torch_save_train.py): resumed nanoGPT-style (`--resume-args=--init_from=resume`) it is `exact`, and its
variant that leaves the LR scheduler out of the checkpoint, resumed like torchtitan from the latest checkpoint in
its folder, changes the run, named as such; HF `Trainer` and Lightning with their own checkpoints and nothing of
detrace: HF's resume is `exact`, Lightning's changes the run and the torch RNG state and data position are named
(one rank each; at 2 ranks, measured, in docs/resume.md); HF at 2 ranks as the tracer sees it. Real processes, one
check each; the logic (the clean slate, the refusals, --resume-args) is in tests/unit/test_native_resume.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tools import tree

from detrace.cli import main
from detrace.tracefile.checkpoints import read_checkpoint_log
from detrace.tracefile.state_parts import read_state_parts

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parents[2] / "examples" / "torch_save_train.py")
SCRIPTS = Path(__file__).parents[1] / "support" / "scripts"


def _check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *cmd: str,
           resume_args: str | None = None) -> tuple[int, dict]:
    monkeypatch.chdir(tmp_path)
    resume = [f"--resume-args={resume_args}"] if resume_args else []
    code = main(["check-resume", "--native", "--at", "4", *resume, "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, *cmd])
    return code, json.loads(capsys.readouterr().out)


def test_a_torch_save_loop_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(tmp_path, monkeypatch, capsys, SCRIPT, "--steps", "6", "--init_from=scratch",
                          resume_args="--init_from=resume")
    assert (code, report["verdict"]) == (0, "exact"), report
    [point] = report["points"]
    assert point["resume"]["verdict"] == "identical" and point["controls"][0]["control"] == "skip-rng"
    assert point["controls"][0]["mattered"]  # its dropout draws from the restored RNG state
    # the restored state, part by part, is the continuous run's (Python's and NumPy's RNG: never seeded, not compared)
    assert {c["part"]: c["equal"] for c in point["restored"]} == {
        "parameters": True, "optimizer state": True, "param groups": True, "scheduler": True, "torch RNG state": True,
        "Python RNG state": None, "NumPy RNG state": None, "data position": True}
    # the continuous run's checkpoints are back in place, the other arms' in OUT
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2.pt", "step-4.pt", "step-6.pt"]
    assert (tmp_path / "check" / "saved-by-cmd" / "at-4" / "stopped" / "checkpoints" / "step-4.pt").is_file()


def test_a_checkpoint_without_the_scheduler_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(tmp_path, monkeypatch, capsys, SCRIPT, "--steps", "6", "--no-scheduler")
    assert (code, report["verdict"]) == (1, "resume-changed-the-run"), report
    first = report["first"]
    assert (first["step"], first["phase"], first["origin"]) == (5, "optimizer", True)
    assert "does your checkpoint save the scheduler" in report["forgot"]
    # before the first resumed update, only the scheduler differs (the lr it set is restored with the optimizer)
    [point] = report["points"]
    assert [c["part"] for c in point["restored"] if c["equal"] is False] == ["scheduler"]
    [scheduler] = [c for c in point["restored"] if c["part"] == "scheduler"]
    assert (scheduler["resumed"], scheduler["continuous"]) == ("LambdaLR at its step 0", "LambdaLR at its step 4")


def test_hf_trainer_without_the_callback_at_two_ranks_is_seen_by_the_tracer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF `Trainer` with nothing of detrace, under torchrun, 2 ranks: one run of check-resume --native's stopped
    arm (the whole check costs ~75 s of CPU at 2 ranks; its verdict, measured, is in docs/resume.md). Each rank's
    own saves at step 4 are logged with their files, its RNG states found where HF put them (by where they came
    from, not by their shape), the process ends right after the save, and its state is digested per rank."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DETRACE_NATIVE_STOP_AT", "4")
    monkeypatch.setenv("DETRACE_STATE_AT", "4")
    script = str(SCRIPTS / "hf_trainer.py")
    assert main(["run", "--out", str(tmp_path / "run"), "--", sys.executable, "-m", "torch.distributed.run",
                 "--standalone", "--nproc-per-node", "2", script, "--out", "hf"]) == 0
    log = read_checkpoint_log(tmp_path / "run")
    assert {io.completed for io in log} == {4} and all(io.op == "save" for io in log)
    rng = {Path(path).name: io.rng for io in log for path in io.paths if "rng_state" in path}
    assert set(rng) == {"rng_state_0.pth", "rng_state_1.pth"}  # each rank's own
    assert {kind for saved in rng.values() for kind, _ in saved} >= {"python", "numpy", "torch"}
    assert not (tmp_path / "hf" / "checkpoint-8").exists()  # stopped right after its save at step 4
    states = read_state_parts(tmp_path / "run")
    assert sorted((s.step, s.rank) for s in states) == [(4, 0), (4, 1)]
    assert states[0].parts["parameters"] == states[1].parts["parameters"]  # DDP: the same model on both ranks


def test_hf_trainers_own_resume_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """HF `Trainer` with `save_steps=4` and `trainer.train(resume_from_checkpoint=...)`, no detrace callback."""
    pytest.importorskip("transformers")
    code, report = _check(tmp_path, monkeypatch, capsys, str(SCRIPTS / "hf_trainer.py"), "--out", "hfout",
                          resume_args="--resume")
    assert (code, report["verdict"]) == (0, "exact"), report
    [point] = report["points"]
    # HF's rng_state.pth is found and left out by skip-rng; this model has no dropout, so the optimizer state matters
    assert point["depends"].startswith("after step 4 this run depends on its optimizer state, not on its RNG states")
    assert all(c["equal"] for c in point["restored"]), point["restored"]  # HF seeds Python's and NumPy's RNGs too


def test_lightnings_own_resume_forgets_the_torch_rng_and_the_data_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's `ModelCheckpoint` and `fit(ckpt_path=...)`, no detrace callback, a shuffled DataLoader: Lightning's
    checkpoint holds no torch RNG state, from which the DataLoader draws the resumed epoch's order."""
    pytest.importorskip("lightning")
    code, report = _check(tmp_path, monkeypatch, capsys, str(SCRIPTS / "lightning_own_checkpoints.py"),
                          resume_args="--resume")
    assert (code, report["verdict"]) == (1, "resume-changed-the-run"), report
    assert (report["first"]["rank"], report["first"]["step"]) == (0, 4)
    [point] = report["points"]
    differs = {c["part"] for c in point["restored"] if c["equal"] is False}
    assert differs == {"torch RNG state", "data position"}, point["restored"]
    assert "the RNG state is not the continuous run's" in report["forgot"] and "data order" in report["forgot"]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_check_stopped_by_a_signal_leaves_every_user_file_as_it_was(sig: signal.Signals, tmp_path: Path) -> None:
    """A real check, its user's checkpoint moved aside (--force), stopped as its resumed arm runs: SIGHUP (the
    terminal closed) puts every file back and exits 129; after SIGKILL, `--recover OUT` does. A project folder
    holds the script and its checkpoint folder; compared: every entry's bytes, name and place."""
    work = tmp_path / "work"
    project = work / "proj"
    project.mkdir(parents=True)
    shutil.copy(SCRIPT, project / "train.py")
    cmd = [sys.executable, "proj/train.py", "--ckpt-dir", "proj/ck", "--steps", "6"]
    subprocess.run([*cmd[:-1], "4"], cwd=work, check=True, capture_output=True)  # the user's own checkpoints
    (project / "ck" / "latest").symlink_to("step-4.pt")
    (project / "ck" / "empty").mkdir()
    before = tree(work)
    out = tmp_path / "check"
    check = subprocess.Popen([sys.executable, "-m", "detrace", "check-resume", "--native", "--force", "--at", "2",
                              "--out", str(out), "--", *cmd], cwd=work, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert check.stderr is not None
    for line in check.stderr:
        if "run resumed after step 2" in line:  # the user's checkpoint is in OUT, the stopped arm's in its place
            check.send_signal(sig)
            break
    else:
        pytest.fail(f"the check ended before its resumed arm (exit code {check.wait()})")
    assert check.wait(timeout=120) == (129 if sig == signal.SIGHUP else -signal.SIGKILL)
    said = check.stderr.read()
    if sig == signal.SIGHUP:
        assert "interrupted by SIGHUP; CMD's checkpoints are back where they were" in said
    else:
        assert tree(work) != before  # the user's checkpoints are in OUT
        deadline = time.monotonic() + 60  # the watchdog ends the killed check's CMD, which writes there till then
        while time.monotonic() < deadline and any(_cwd(pid) == work for pid in Path("/proc").glob("[0-9]*")):
            time.sleep(0.2)
        done = subprocess.run([sys.executable, "-m", "detrace", "check-resume", "--recover", str(out)],
                              cwd=work, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        assert "put back what the check-resume --native in" in done.stderr
    assert tree(work) == before


def _cwd(pid: Path) -> Path | None:
    try:
        return Path(os.readlink(pid / "cwd"))
    except OSError:  # gone, or not ours to read
        return None
