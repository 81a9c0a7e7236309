"""`detrace check`: run-to-run identity verified on a user's command: N runs from the same state must be
bit-identical. It drives the launcher and the diff; it never reads a trace itself. `detrace check-resume`
(check_resume.py) builds on its runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from detrace.analyze import DiffResult, diff
from detrace.errors import CommandFailed, UsageError
from detrace.launch.launcher import Launcher, LaunchResult, run_traced
from detrace.tracefile.layout import prepare_out
from detrace.verdicts import DIFF

# The rung both checks record: exact metrics plus every collective, recompute and optimizer tensor. It is
# the cheapest rung that sees a divergence in any rank's state at the step it happens.
CHECK_RUNG = "semantic"

Progress = Callable[[str], None]


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

    @property
    def exit_code(self) -> int:
        """`detrace diff`'s codes: 0 when every run is identical to the first, else 1 (an incomparable run too:
        runs of one command that cannot be compared did not repeat themselves)."""
        return DIFF["identical" if self.identical else "diverged"]


def run_checked(cmd: list[str], out: Path, *, label: str, progress: Progress, timeout: float | None,
            launch: Launcher, steps: str = "all", env: dict[str, str] | None = None) -> LaunchResult:
    """One traced run of CMD at the checks' rung; a nonzero exit is a CommandFailed naming the run."""
    progress(f"{label}: {out}")
    result = launch(cmd, out, rung=CHECK_RUNG, steps=steps, env=env, timeout=timeout, quiet=True)
    if result.returncode != 0:
        raise CommandFailed(
            f"{label} exited with code {result.returncode}; its output ends with:\n{result.output_tail.rstrip()}")
    return result


def check(cmd: list[str], *, runs: int = 2, out: Path, timeout: float | None = None,
          progress: Progress = lambda _: None, launch: Launcher = run_traced) -> CheckResult:
    """Run CMD `runs` times from the same state and compare every run with the first."""
    if runs < 2:
        raise UsageError(f"--runs must be at least 2 to compare anything, got {runs}")
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check -- python train.py")
    out = prepare_out(out, holds="runs")
    dirs = [out / f"run-{i}" for i in range(runs)]
    for i, run_dir in enumerate(dirs):
        run_checked(cmd, run_dir, label=f"run {i + 1}/{runs}", progress=progress, timeout=timeout, launch=launch)
    return CheckResult(runs=dirs, diffs=[diff(dirs[0], other) for other in dirs[1:]])
