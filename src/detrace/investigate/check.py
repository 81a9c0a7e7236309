"""`detrace check`: run-to-run identity verified on a user's command: N runs from the same state must be
bit-identical. It drives the launcher and the diff; it never reads a trace itself. `detrace check-resume`
(check_resume.py) builds on its runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from detrace.analyze import DiffResult, diff
from detrace.errors import CommandFailed, IncomparableError, TraceError, UsageError
from detrace.launch.launcher import Launcher, LaunchResult, run_traced
from detrace.tracefile import open_run
from detrace.tracefile.checkpoints import CheckpointIO, read_checkpoint_log
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
    from detrace.state.contract import ENV_CKPT_DIR  # imports torch: not at the CLI's start

    started = time.time()
    for i, run_dir in enumerate(dirs):
        # Each run gets its own DETRACE_CKPT_DIR: a script that writes there cannot resume from an earlier run's files.
        run_checked(cmd, run_dir, label=f"run {i + 1}/{runs}", progress=progress, timeout=timeout, launch=launch,
                    env={ENV_CKPT_DIR: str(out / "checkpoints" / run_dir.name)})
    refuse_one_sided_loads(dirs)
    refuse_self_resumed(dirs, started=started, out=out)
    return CheckResult(runs=dirs, diffs=[diff(dirs[0], other) for other in dirs[1:]])


def _first_step(run: Path) -> int | None:
    try:
        steps = open_run(run).header.steps
    except TraceError:
        return None  # the diff says what is wrong with the run
    return steps[0] if steps is not None else None


def written_since(started: float, *, out: Path, where: Path | None = None) -> list[Path]:
    """The entries of `where` (the working directory) changed since `started`, other than the check's own `out`:
    where CMD may have left a checkpoint."""
    where = where or Path.cwd()
    own = out.resolve()
    found = []
    try:
        with os.scandir(where) as entries:
            for entry in entries:
                path = Path(entry.path)
                resolved = path.resolve()
                if resolved == own or resolved in own.parents:
                    continue
                try:
                    # A second of slack: file times are taken from a coarser clock than time.time().
                    if entry.stat(follow_symlinks=False).st_mtime >= started - 1.0:
                        found.append(path)
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(found)


def _loads(run: Path) -> list[CheckpointIO]:
    try:
        return [io for io in read_checkpoint_log(run) if io.op == "load"]
    except TraceError:
        return []  # an unreadable log: the diff says what is wrong with the run


def refuse_one_sided_loads(dirs: list[Path], *, command: str = "check", labels: list[str] | None = None) -> None:
    """Raise IncomparableError when one run loaded a checkpoint and the first did not (or the other way round, or they
    loaded different files: a checkpoint left before the check, then the first run's): CMD
    resumes by itself from the newest checkpoint under its own folder (torchtitan's, DCP's or `torch.load`'s
    auto-resume), and an earlier run left one there. The global step may not show it (a DCP load of Stateful
    objects carries no optimizer step count), but the checkpoint log does.

    `command`: the detrace command that ran them (`check`, `locate`), named in the advice; `labels`: how the
    sentence names each run of `dirs` (default: their numbers, 1 for the first)."""
    names = labels or [str(i) for i in range(1, len(dirs) + 1)]
    first = _loads(dirs[0])
    for i, run in enumerate(dirs[1:], start=1):
        theirs = _loads(run)
        if _loaded(first) == _loaded(theirs) and bool(first) == bool(theirs):
            continue
        loader, number, other = (theirs, names[i], names[0]) if theirs else (first, names[0], names[i])
        paths = _loaded(loader)
        named = Path(paths[0]) if paths else None
        folder = named.parent if named is not None else None
        what = f"a checkpoint from {named}" if named is not None else f"a checkpoint ({loader[0].api})"
        others = _loaded(first if loader is theirs else theirs)
        said = f"{others[0]}" if others else "none"
        clean = (f"delete {folder} before `detrace {command}`" if folder is not None and str(folder) not in ("", ".")
                 else f"move its checkpoints away before `detrace {command}`")
        raise IncomparableError(
            f"run {number} loaded {what} and run {other} loaded {said}: CMD resumes by itself from a checkpoint that "
            f"an earlier run left{f' in {folder}' if folder is not None else ''}, so the runs did not start from the "
            f"same state; give each run a clean one: {clean}, turn the script's auto-resume off, or have the script "
            f"take its checkpoint folder from DETRACE_CKPT_DIR, which detrace {command} sets to a new directory for "
            "each run")


def _loaded(loads: list[CheckpointIO]) -> list[str]:
    """The paths a run's loads named, in order."""
    return [path for io in loads for path in io.paths]


def refuse_self_resumed(dirs: list[Path], *, started: float, out: Path) -> None:
    """Raise IncomparableError when a run started at a later global step than the first: CMD resumed by itself from
    a checkpoint an earlier run left (torchtitan's auto-resume, HF's `get_last_checkpoint`, Lightning's
    `ckpt_path="last"`), so the runs did not start from the same state and comparing them says nothing."""
    first = _first_step(dirs[0])
    for i, run in enumerate(dirs[1:], start=2):
        theirs = _first_step(run)
        if first is None or theirs is None or theirs <= first:
            continue
        left = written_since(started, out=out)
        where = (" (the working directory's " + ", ".join(str(p) for p in left[:4]) + " changed during the runs)"
                 if left else "")
        raise IncomparableError(
            f"run {i} started at global step {theirs} and run 1 at step {first}: CMD resumed by itself from a "
            f"checkpoint that an earlier run left{where}, so the runs did not start from the same state; give each "
            "run a clean output directory: delete it before `detrace check`, turn the script's auto-resume off, or "
            "have the script take its output directory from DETRACE_CKPT_DIR, which detrace check sets to a new "
            "directory for each run")
