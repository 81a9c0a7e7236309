"""The two guarantees, verified on a user's command: run-to-run identity (`check`) and exact resume
(`check-resume`). Both drive the launcher and the diff; neither reads a trace itself.

check-resume speaks to CMD through the environment contract that `detrace.TrainState` implements
(DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME, DETRACE_RESUME_CONTROL; see docs/resume.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from detrace.compare import DiffResult, diff
from detrace.errors import CommandFailed, UsageError
from detrace.tracing.launch import LaunchResult, run_traced

# The rung both checks record: exact metrics plus every collective, recompute and optimizer tensor. It is
# the cheapest rung that sees a divergence in any rank's state at the step it happens.
CHECK_RUNG = "semantic"
# The negative control of check-resume: resume without restoring the RNG states.
NEGATIVE_CONTROL = "skip-rng"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """The outcome of `detrace check`."""

    runs: list[Path]
    """Run directories, the first being the reference the others are compared with."""
    diffs: list[DiffResult]
    """One diff per run after the first, against the first."""

    @property
    def identical(self) -> bool:
        return all(d.verdict == "identical" for d in self.diffs)

    @property
    def first_divergent(self) -> DiffResult | None:
        return next((d for d in self.diffs if d.verdict != "identical"), None)


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """The outcome of `detrace check-resume`."""

    at: int
    """The step after which the run was stopped and resumed."""
    continuous: Path
    stopped: Path
    resumed: Path
    control: Path
    resume_diff: DiffResult
    """Continuous vs resumed, from step `at` on: must be identical."""
    control_diff: DiffResult
    """Continuous vs the deliberately wrong resume: must diverge, or the check proves nothing."""
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """'exact', 'diverged' (resume changed bits) or 'unproven' (the negative control did not diverge)."""
        if self.resume_diff.verdict != "identical":
            return "diverged"
        return "exact" if self.control_diff.verdict == "diverged" else "unproven"


Progress = Callable[[str], None]


def _launch(cmd: list[str], out: Path, *, label: str, progress: Progress, timeout: float | None,
            steps: str = "all", env: dict[str, str] | None = None) -> LaunchResult:
    progress(f"{label}: {out}")
    result = run_traced(cmd, out, rung=CHECK_RUNG, steps=steps, env=env, timeout=timeout, quiet=True)
    if result.returncode != 0:
        raise CommandFailed(
            f"{label} exited with code {result.returncode}; its output ends with:\n{result.output_tail.rstrip()}")
    return result


def _fresh(out: Path) -> Path:
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"output directory {out} is not empty; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    return out


def default_out(kind: str) -> Path:
    """A new directory for a check's runs: detrace-<kind>-<timestamp> in the working directory."""
    return Path(f"detrace-{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def check(cmd: list[str], *, runs: int = 2, out: Path, timeout: float | None = None,
          progress: Progress = lambda _: None) -> CheckResult:
    """Run CMD `runs` times from the same state and compare every run with the first."""
    if runs < 2:
        raise UsageError(f"--runs must be at least 2 to compare anything, got {runs}")
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check -- python train.py")
    out = _fresh(out)
    dirs = [out / f"run-{i}" for i in range(runs)]
    for i, run_dir in enumerate(dirs):
        _launch(cmd, run_dir, label=f"run {i + 1}/{runs}", progress=progress, timeout=timeout)
    return CheckResult(runs=dirs, diffs=[diff(dirs[0], other) for other in dirs[1:]])


def check_resume(cmd: list[str], *, at: int, out: Path, timeout: float | None = None,
                 progress: Progress = lambda _: None) -> ResumeResult:
    """Continuous run vs stopped-after-step-`at`-and-resumed, plus a negative control that must diverge."""
    if at < 1:
        raise UsageError(f"--at must be a step of at least 1 (steps completed before stopping), got {at}")
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check-resume --at 3 -- python train.py")
    out = _fresh(out)
    # Only records from step `at` on are compared: the resumed process starts there.
    window = f"{at}::1"
    ckpt = out / "checkpoint"
    continuous, stopped, resumed, control = (out / name for name in ("continuous", "stopped", "resumed", "control"))
    _launch(cmd, continuous, label="continuous run", progress=progress, timeout=timeout, steps=window)
    _launch(cmd, stopped, label=f"run stopped after step {at}", progress=progress, timeout=timeout, steps=window,
            env={"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_STOP_AT": str(at)})
    if not ckpt.exists():
        raise CommandFailed(
            f"CMD wrote no checkpoint to {ckpt} when asked to stop after step {at}; does it use detrace.TrainState "
            "(resume_if_requested / end_of_step), and does it run more than that many steps?")
    resume_env = {"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_RESUME": "1"}
    _launch(cmd, resumed, label="resumed run", progress=progress, timeout=timeout, steps=window, env=resume_env)
    _launch(cmd, control, label=f"negative control ({NEGATIVE_CONTROL})", progress=progress, timeout=timeout,
            steps=window, env={**resume_env, "DETRACE_RESUME_CONTROL": NEGATIVE_CONTROL})
    return ResumeResult(at=at, continuous=continuous, stopped=stopped, resumed=resumed, control=control,
                        resume_diff=diff(continuous, resumed), control_diff=diff(continuous, control))
