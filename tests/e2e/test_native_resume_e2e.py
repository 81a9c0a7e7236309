"""End to end: `detrace check-resume --native` on a loop that checkpoints by itself with `torch.save` and resumes,
like torchtitan, from the latest checkpoint in its folder (examples/torch_save_train.py): its resume is `exact`,
and its variant that leaves the LR scheduler out of the checkpoint changes the run, named as such; HF `Trainer`
without detrace's callback at 2 ranks, as the tracer sees it. Real processes,
one each; the logic (the clean slate, the refusals, --resume-args) is in tests/unit/test_native_resume.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main
from detrace.tracefile.checkpoints import read_checkpoint_log
from detrace.tracefile.state_parts import read_state_parts

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parents[2] / "examples" / "torch_save_train.py")


def _check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           *args: str) -> tuple[int, dict]:
    monkeypatch.chdir(tmp_path)
    code = main(["check-resume", "--native", "--at", "4", "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, SCRIPT, "--steps", "6", *args])
    return code, json.loads(capsys.readouterr().out)


def test_a_torch_save_loop_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(tmp_path, monkeypatch, capsys)
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
    code, report = _check(tmp_path, monkeypatch, capsys, "--no-scheduler")
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
    script = str(Path(__file__).parents[1] / "support" / "scripts" / "hf_trainer.py")
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
