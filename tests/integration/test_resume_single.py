"""Exact resume in one process, run in this one: the contract of `detrace check-resume` (DETRACE_STOP_AT saves and
stops, DETRACE_RESUME resumes) on a workload with every source of randomness a resume can get wrong
(tests/support/_resume_program.py), and its negative control. In real, fresh processes: tests/e2e/test_resume.py
(2 ranks, DDP and FSDP2) and tests/e2e/test_readme_tour.py (check-resume)."""

from __future__ import annotations

from pathlib import Path

from _resume_program import assert_same_tail, run_here


def test_single_process_stop_resume_and_negative_control(tmp_path: Path) -> None:
    """6 batches an epoch: DETRACE_STOP_AT=3 saves and stops mid-epoch; DETRACE_RESUME=1 resumes exactly, there and
    from the epoch boundary K=6; the negative control skip-rng resumes without the RNG states and diverges."""
    continuous = run_here(8, tmp_path / "a", save_at=f"{tmp_path / 'ckpt'}:6")
    stop_dir = str(tmp_path / "stop")
    stopped = run_here(8, tmp_path / "b", DETRACE_STOP_AT="3", DETRACE_CKPT_DIR=stop_dir)
    assert stopped[0]["losses"] == {step: loss for step, loss in continuous[0]["losses"].items() if int(step) <= 3}
    assert (tmp_path / "stop" / "latest").read_text().strip() == "step-00000003"

    resumed = run_here(8, tmp_path / "c", DETRACE_RESUME="1", DETRACE_CKPT_DIR=stop_dir)
    assert_same_tail(continuous, resumed, 3)
    resumed = run_here(8, tmp_path / "d", DETRACE_RESUME="1", DETRACE_CKPT_DIR=str(tmp_path / "ckpt/k6"))
    assert_same_tail(continuous, resumed, 6)

    control = {"DETRACE_RESUME": "1", "DETRACE_CKPT_DIR": stop_dir, "DETRACE_RESUME_CONTROL": "skip-rng"}
    wrong = run_here(8, tmp_path / "e", **control)
    assert wrong[0]["start"] == 3
    assert wrong[0]["losses"]["4"] != continuous[0]["losses"]["4"]
    assert wrong[0]["params"] != continuous[0]["params"]
