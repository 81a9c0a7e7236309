"""`detrace check-resume`: exact resume verified on a user's command, a proof with four arms (a continuous run,
the same again, stopped after step K and resumed in a fresh process, and a negative control that must diverge).
It drives the launcher and the diff; it never reads a trace itself.

check-resume speaks to CMD through the environment contract that `detrace.TrainState` implements
(DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME, DETRACE_RESUME_CONTROL; see docs/resume.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from detrace._numbers import parse_count
from detrace.analyze import DiffResult, diff
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.integrations.advice import advice
from detrace.investigate.check import Progress, run_checked
from detrace.launch.launcher import Launcher, LaunchResult, run_traced
from detrace.tracefile import open_run
from detrace.tracefile.layout import prepare_out
from detrace.verdicts import RESUME, ResumeVerdict

# The negative control of check-resume: resume without restoring the RNG states.
NEGATIVE_CONTROL = "skip-rng"


@dataclass(frozen=True, kw_only=True)
class StopPoint:
    """One stop point of `detrace check-resume`: stopped after step `at`, resumed, and the negative control."""

    at: int
    """The step after which the run was stopped and resumed (a global step: steps counted from 1)."""
    verdict: ResumeVerdict
    """exact, resume-changed-the-run, nondeterministic (the resumed run did not repeat itself) or inconclusive."""
    stopped: Path
    resumed: Path
    resume_diff: DiffResult
    """Continuous vs resumed, on the steps both have (`at` and up)."""
    control: Path | None = None
    control_diff: DiffResult | None = None
    """Continuous vs the deliberately wrong resume (run when the resume matched): must diverge."""
    resumed_again: Path | None = None
    again_diff: DiffResult | None = None
    """Resumed vs resumed once more (run when the resume differed): a resume that changes the run does so the
    same way twice; a run that differs from itself is nondeterministic."""

    @property
    def first(self) -> DiffResult | None:
        """The diff that names this point's verdict."""
        if self.verdict == "nondeterministic":
            return self.again_diff
        if self.verdict == "inconclusive":
            return self.control_diff
        return self.control_diff if self.verdict == "exact" else self.resume_diff


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """The outcome of `detrace check-resume`: four arms (continuous, continuous again, stopped and resumed, the
    negative control), the last two per stop point."""

    at: list[int]
    """The stop points, ascending."""
    continuous: Path
    again: Path
    repeat_diff: DiffResult
    """Continuous vs continuous again: must be identical, or nothing can be said of the resume."""
    points: list[StopPoint] = field(default_factory=list)
    """One per stop point; empty when the two continuous runs differ (no resume was tried)."""

    @property
    def verdict(self) -> ResumeVerdict:
        """nondeterministic (before anything else: never blame a resume for a run that differs from itself), then
        resume-changed-the-run, inconclusive (a control that did not diverge proves nothing), exact."""
        if self.repeat_diff.verdict != "identical":
            return "nondeterministic"
        verdicts = {point.verdict for point in self.points}
        order: tuple[ResumeVerdict, ...] = ("nondeterministic", "resume-changed-the-run", "inconclusive", "exact")
        return next(v for v in order if v in verdicts)

    @property
    def exit_code(self) -> int:
        return RESUME[self.verdict]

    @property
    def deciding(self) -> DiffResult:
        """The diff whose first divergence the verdict names."""
        if self.repeat_diff.verdict != "identical":
            return self.repeat_diff
        point = next(p for p in self.points if p.verdict == self.verdict)
        return point.first  # type: ignore[return-value]


def parse_stop_points(text: str) -> list[int]:
    """`--at 2,5`: the stop points, ascending, each a step of at least 1."""
    points = set()
    for item in text.split(","):
        point = parse_count(item)
        if point is None or point < 1:
            raise UsageError(f"--at must be a step of at least 1 (steps completed before stopping), or several "
                             f"such as 2,5; not {text!r}")
        points.add(point)
    return sorted(points)


def _comparable(result: DiffResult, what: str) -> DiffResult:
    if result.verdict == "incomparable":
        raise CommandFailed(f"{what} cannot be compared: {result.reason}")
    return result


def check_resume(cmd: list[str], *, at: list[int], out: Path, timeout: float | None = None,
                 progress: Progress = lambda _: None, launch: Launcher = run_traced) -> ResumeResult:
    """The four-arm resume proof: a continuous run, a second continuous run (equal to the first, or the run is
    nondeterministic and no resume can be judged), for each stop point K a run stopped after step K and resumed
    (equal to the continuous run from step K on), and a negative control that must diverge. A resumed run that
    differs is resumed once more: only a difference that repeats is blamed on the resume."""
    if not at or any(k < 1 for k in at):
        raise UsageError(f"--at must be a step of at least 1 (steps completed before stopping), got {at}")
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check-resume --at 3 -- python train.py")
    at = sorted(set(at))
    out = prepare_out(out, holds="runs")
    # Records before the first stop point are never compared: the resumed processes start there or later.
    window = f"{at[0]}::1"
    continuous, again = out / "continuous", out / "continuous-again"
    arm = functools.partial(run_checked, cmd, progress=progress, timeout=timeout, launch=launch, steps=window)
    arm(continuous, label="continuous run")
    last = _last_step(continuous)
    if last is None or last < at[-1]:
        # Checked after the first run, not after both: a stop point at or past the end leaves nothing to resume.
        ran = f"no step from {at[0]} on" if last is None else f"its last step at {last}"
        raise UsageError(f"the continuous run ended with {ran} (steps count from 0), so stopping after "
                         f"{at[-1]} steps leaves no step to resume; give --at below the run's step count")
    arm(again, label="continuous run, again")
    repeat = _comparable(diff(continuous, again), "the two continuous runs")
    result = ResumeResult(at=at, continuous=continuous, again=again, repeat_diff=repeat)
    if repeat.verdict != "identical":
        return result
    for k in at:
        result.points.append(_stop_point(arm, k, out / f"at-{k}", continuous, cmd))
    return result


def _last_step(run: Path) -> int | None:
    """The last global step a finished run recorded (run.json's `steps`, from its ranks' footers), or None."""
    try:
        steps = open_run(run).header.steps
    except TraceError:
        return None
    return None if steps is None else steps[1]


def _stop_point(arm: Callable[..., LaunchResult], k: int, out: Path, continuous: Path, cmd: list[str]) -> StopPoint:
    """One stop point's arms; `arm(out, label=..., env=...)` runs CMD traced over the proof's step window."""
    ckpt = out / "checkpoint"
    stopped, resumed = out / "stopped", out / "resumed"
    arm(stopped, label=f"run stopped after step {k}", env={"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_STOP_AT": str(k)})
    if not ckpt.exists():
        raise CommandFailed(
            f"CMD wrote no checkpoint to {ckpt} when asked to stop after step {k}; does it use {advice(cmd)}, and "
            "does it run more than that many steps?")
    resume_env = {"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_RESUME": "1"}
    arm(resumed, label=f"run resumed after step {k}", env=resume_env)
    resume_diff = _comparable(diff(continuous, resumed), f"the continuous run and the run resumed after step {k}")
    if resume_diff.verdict != "identical":
        again = out / "resumed-again"
        arm(again, label=f"run resumed after step {k}, again", env=resume_env)
        again_diff = _comparable(diff(resumed, again), f"the two runs resumed after step {k}")
        verdict: ResumeVerdict = "resume-changed-the-run" if again_diff.verdict == "identical" else "nondeterministic"
        return StopPoint(at=k, verdict=verdict, stopped=stopped, resumed=resumed, resume_diff=resume_diff,
                         resumed_again=again, again_diff=again_diff)
    control = out / "control"
    arm(control, label=f"negative control after step {k} ({NEGATIVE_CONTROL})",
        env={**resume_env, "DETRACE_RESUME_CONTROL": NEGATIVE_CONTROL})
    control_diff = _comparable(diff(continuous, control), f"the continuous run and the negative control after "
                                                          f"step {k}")
    verdict = "exact" if control_diff.verdict == "diverged" else "inconclusive"
    return StopPoint(at=k, verdict=verdict, stopped=stopped, resumed=resumed, resume_diff=resume_diff,
                     control=control, control_diff=control_diff)
