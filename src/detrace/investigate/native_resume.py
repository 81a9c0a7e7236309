"""`detrace check-resume --native`: the four-arm resume proof on a script's own checkpoints, with no edit to it.

The tracer logs every checkpoint save and load CMD makes (`torch.save` / `torch.load`, safetensors,
`torch.distributed.checkpoint`; detrace.record.rungs.checkpoints): the stopped arm ends as the optimizer step after
step K begins, once CMD's own save at step K has returned (as a preemption would), and the resumed arm runs CMD
again, which resumes by itself from what is on disk, or with `--resume-args` appended. The negative controls change
what CMD loads (its optimizer state emptied, its RNG states replaced by the process's own).

Every arm starts from a clean slate: the files an arm wrote in its checkpoint folders (the folders that the saves
and loads of the arms so far named, found in their logs; never the whole working directory) are moved aside into
OUT, never deleted; a file is an arm's when it was written after the check began. The stopped arm's files are put
back in place before each resumed arm. At the end the first continuous run's files are put back (what one run of
CMD leaves). A checkpoint that was there before the check, which CMD's continuous run loaded, is refused in one
sentence, or with `--force` moved aside for the check and put back after it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from detrace.errors import CommandFailed, UsageError
from detrace.investigate.check_resume import Contract, RerunArm
from detrace.tracefile.checkpoints import CheckpointIO, read_checkpoint_log
from detrace.tracefile.layout import RUNS_DIR

_SKIPPED_DIRS = {".git", "__pycache__", RUNS_DIR}
"""Never CMD's checkpoints: walked past when looking for the files an arm wrote."""
OUTSIDE = "outside-working-directory"
"""Under an arm's folder in OUT: the files its saves named outside the working directory, by their absolute path."""


class NativeContract(Contract):
    """check-resume's arms driven through CMD's own checkpoints (see the module's docstring)."""

    def __init__(self, cmd: list[str], *, out: Path, resume_args: Sequence[str] = (), force: bool = False,
                 root: Path | None = None) -> None:
        # Imported here: the package detrace.state imports torch, which the command does not need before it runs.
        from detrace.state.contract import NATIVE_CONTROLS

        super().__init__(cmd)
        self.controls = NATIVE_CONTROLS
        self.root = (root if root is not None else Path.cwd()).resolve()
        self.out = out.resolve()
        self.resume_args = list(resume_args)
        self.force = force
        self.aside = self.out / "saved-by-cmd"
        """Where each arm's files go: `saved-by-cmd/<arm>/...` (a stop point's under `at-K/...`)."""
        self.before_check = self.out / "before-check"
        """With --force: the checkpoints that were there before the check."""
        with tempfile.NamedTemporaryFile() as stamp:  # the clock files are stamped with (coarser than time's)
            self.start = os.stat(stamp.name).st_mtime_ns
        """When the check began: a file modified since is an arm's, one older was there before the check."""
        self.folders: set[Path] = set()
        """The checkpoint folders in the working directory that the arms' saves and loads named so far (the working
        directory itself for a file saved there: its own files only)."""
        self.running: Path | None = None
        """The run of the arm under way (its log says what a failed arm saved)."""
        self.rng: dict[Path, dict[str, list[list[object]]]] = {}
        """Per stop point, where the stopped run's saves put RNG states, per file (for the skip-rng control)."""
        self.saves: list[CheckpointIO] = []
        """The continuous run's saves (what --at can name)."""
        self.discarded = 0
        """Continuous runs that resumed from a checkpoint that was there before the check."""

    # -- the arms ---------------------------------------------------------------------------------------------

    def before(self, arm: str, run: Path, point: Path | None) -> None:
        self.running = run
        if point is not None and arm != "stopped":
            self._copy_back(self._stash(point))  # the stopped arm's checkpoint, as that arm left it

    def after(self, arm: str, run: Path, point: Path | None) -> None:
        self.running = None
        log = read_checkpoint_log(run)
        self._learn(log)
        if point is None:  # a continuous arm
            old = self._old_checkpoint(log)
            if old is not None:
                self.discarded += 1  # its files (saved after it resumed) go aside as well, apart from the others
                self._move_aside(self.aside / f"{run.name}-resumed-from-an-old-checkpoint-{self.discarded}", log)
                self._set_aside(run.name, old)
            self._move_aside(self.aside / run.name, log)
            if arm == "continuous":
                self.saves = [io for io in log if io.op == "save"]
        elif arm == "stopped":
            self._move_aside(self._stash(point), log)
        else:
            self._move_aside(self.aside / point.name / run.name, log)
            if not any(io.op == "load" for io in log):
                given = f" even with --resume-args {' '.join(self.resume_args)}" if self.resume_args else ""
                raise CommandFailed(f"CMD did not resume{given}: its {run.name} run after {point.name} loaded no "
                                    "checkpoint; give --resume-args with the arguments that make it resume (such as "
                                    "--resume-args=--init_from=resume)")

    def stop(self, k: int, point: Path) -> tuple[list[str], dict[str, str]]:
        from detrace.state.contract import ENV_NATIVE_STOP_AT  # see __init__

        return self.cmd, {ENV_NATIVE_STOP_AT: str(k)}

    def stopped(self, k: int, run: Path, point: Path) -> None:
        log = read_checkpoint_log(run)
        self.rng[point] = {str(self._absolute(path)): [[kind, list(key_path)] for kind, key_path in io.rng]
                           for io in log if io.op == "save" and io.rng for path in io.paths}
        if any(io.op == "save" and io.completed == k for io in log):
            return
        steps = sorted({io.completed for io in self.saves})
        if not steps:
            raise CommandFailed("CMD saved no checkpoint (torch.save, safetensors or torch.distributed.checkpoint) in "
                                "its continuous run, so there is nothing of its own to resume from")
        raise UsageError(f"CMD saved no checkpoint after step {k}: its continuous run saved after steps "
                         f"{', '.join(map(str, steps))}; give --at one of them")

    def resume(self, point: Path, control: str | None = None) -> tuple[list[str], dict[str, str]]:
        from detrace.state.contract import ENV_NATIVE_CONTROL, ENV_NATIVE_RNG  # see __init__

        env = {ENV_NATIVE_CONTROL: control} if control is not None else {}
        if control == "skip-rng":
            env[ENV_NATIVE_RNG] = json.dumps(self.rng.get(point, {}))
        return [*self.cmd, *self.resume_args], env

    def applied(self, control: str, run: Path) -> bool:
        return any(io.op == "load" and io.control == control for io in read_checkpoint_log(run))

    def finish(self) -> None:
        """Put back the checkpoints that were there before the check (with --force), else the first continuous
        run's files; the other arms' stay under OUT. An arm that failed left its files in place: they go aside
        first."""
        if self.running is not None:
            log = read_checkpoint_log(self.running) if self.running.is_dir() else []
            self._learn(log)
            self._move_aside(self.aside / "unfinished-arm", log)
        source = self.before_check if self.before_check.exists() else self.aside / "continuous"
        if not source.exists() or (source != self.before_check and not self.saves):
            return  # (the continuous run was refused: its files stay in OUT)
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            destination = self._place(path.relative_to(source))
            if not destination.exists():  # else it stays in OUT
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(path, destination)

    # -- the files --------------------------------------------------------------------------------------------

    def _stash(self, point: Path) -> Path:
        return self.aside / point.name / "stopped"

    def _absolute(self, path: str | Path) -> Path:
        return (self.root / path).absolute()  # (an absolute path stays as it is)

    def _learn(self, log: list[CheckpointIO]) -> None:
        """Add the checkpoint folders an arm's saves and loads named in the working directory."""
        for io in log:
            for path in io.paths:
                absolute = self._absolute(path)
                folder = absolute if absolute.is_dir() else absolute.parent  # (a DCP checkpoint is a folder)
                if folder.resolve().is_relative_to(self.root):
                    self.folders.add(folder.resolve())

    def _written(self) -> tuple[list[str], list[str]]:
        """The files the arms wrote in the checkpoint folders (written since the check began), and the folders,
        each relative to the working directory: the working directory's own files only, not its subfolders."""
        files: list[str] = []
        for folder in sorted(self.folders):
            if not folder.is_dir():
                continue
            walk = os.walk(folder) if folder != self.root else [(str(folder), [], os.listdir(folder))]
            for top, names, filenames in walk:
                here = Path(top)
                names[:] = [n for n in names if n not in _SKIPPED_DIRS and (here / n).resolve() != self.out]
                files += [str((here / n).relative_to(self.root)) for n in filenames
                          if (here / n).is_file() and (here / n).stat().st_mtime_ns >= self.start]
        return sorted(set(files)), [str(f.relative_to(self.root)) for f in sorted(self.folders) if f != self.root]

    def _old_checkpoint(self, log: list[CheckpointIO]) -> str | None:
        """A checkpoint a continuous run loaded that it did not save: one that was there before the check."""
        saved = {path for io in log if io.op == "save" for path in io.paths}
        return next((path for io in log if io.op == "load" for path in io.paths
                     if path not in saved and self._existed(path)), None)

    def _set_aside(self, arm: str, old: str) -> None:
        """Refuse the old checkpoint in one sentence, or with --force move its folder aside and run the arm again."""
        if not self.force:
            raise UsageError(f"CMD's {arm} run loaded {old}, a checkpoint that was there before the check, so it "
                             "resumed instead of starting from scratch: move it away, or give --force to have it "
                             "moved aside for the check and put back after")
        top = self._top(Path(old))
        target = self.before_check / self._name(top)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(top, target)
        raise RerunArm(f"moved aside {top}, which CMD's {arm} run resumed from, into {target}")

    def _existed(self, path: str) -> bool:
        """Whether the file or folder was there before the check: not written since it began."""
        try:
            return self._absolute(path).stat().st_mtime_ns < self.start
        except OSError:
            return False

    def _top(self, path: Path) -> Path:
        """What --force moves aside for a checkpoint file: its folder in the working directory (the folder CMD
        looks for its latest checkpoint in), or its own folder outside it."""
        absolute = (self.root / path).resolve()
        if absolute.is_relative_to(self.root):
            parts = absolute.relative_to(self.root).parts
            return self.root / parts[0] if len(parts) > 1 else absolute
        return absolute.parent

    def _move_aside(self, target: Path, log: list[CheckpointIO]) -> None:
        """Move the files the arm wrote into `target` (the new files of the checkpoint folders, and what its saves
        named outside the working directory), and remove the checkpoint folders that are empty now."""
        files, folders = self._written()
        for relative in files:
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.root / relative, destination)
        for relative in sorted(folders, key=len, reverse=True):
            folder = self.root / relative
            while folder != self.root and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()  # an empty folder, or one the arm made: the files put back make it again
                folder = folder.parent
        for io in log:
            for path in io.paths:
                absolute = Path(path).absolute()
                if io.op == "save" and not absolute.is_relative_to(self.root) and absolute.exists():
                    destination = target / self._name(absolute)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(absolute, destination)

    def _copy_back(self, stash: Path) -> None:
        for source in sorted(p for p in stash.rglob("*") if p.is_file()):
            destination = self._place(source.relative_to(stash))
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)

    def _name(self, path: Path) -> Path:
        """Where `path` goes under an arm's folder in OUT: its place in the working directory, or `OUTSIDE/...`."""
        absolute = path.absolute()
        if absolute.is_relative_to(self.root):
            return absolute.relative_to(self.root)
        return Path(OUTSIDE, *absolute.parts[1:])

    def _place(self, name: Path) -> Path:
        """The inverse of `_name`."""
        if name.parts[0] == OUTSIDE:
            return Path("/", *name.parts[1:])
        return self.root / name
