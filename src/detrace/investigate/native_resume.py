"""`detrace check-resume --native`: the four-arm resume proof on a script's own checkpoints, with no edit to it.

The tracer logs every checkpoint save and load CMD makes (`torch.save` / `torch.load`, safetensors,
`torch.distributed.checkpoint`; detrace.record.rungs.checkpoints): the stopped arm ends as the optimizer step after
step K begins, once CMD's own save at step K has returned (as a preemption would), and the resumed arm runs CMD
again, which resumes by itself from what is on disk, or with `--resume-args` appended (`{K}` in them is the stop
step). The negative controls change what CMD loads (its optimizer state emptied, its RNG states replaced by the
process's own).

Every arm starts from a clean slate: the files an arm wrote in its checkpoint folders (the folders that the saves
and loads of the arms so far named, found in their logs; in the working directory itself only the files a save
named) are moved aside into OUT, never deleted. Old is told from new by a snapshot of the working directory taken
before the first arm (kind, size, inode and modification time of each entry; never the clock): an entry that is in
the snapshot and unchanged is the user's and never moves. The stopped arm's files are put back in place before each
resumed arm. At the end the first continuous run's files are put back (what one run of CMD leaves). A checkpoint
that was there before the check, which CMD's continuous run loaded, is refused in one sentence, or with `--force`
its checkpoint folder (never a folder that holds CMD's script or another file its arguments name) is moved aside
for the check and put back after it, whole: files, empty folders and links alike.

As careful as git with a working tree: a journal in OUT (JSON, written atomically before anything moves) says what
moved where; a check that was killed (SIGKILL, a power cut) leaves it unfinished, and the next check in the same
working directory, or `check-resume --recover OUT`, puts the files back from it. One check at a time moves files in
a working directory: it holds a lock there (`detrace-runs/native-check.lock`, naming its OUT).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.investigate.check_resume import Contract, RerunArm
from detrace.tracefile.checkpoints import CheckpointIO, read_checkpoint_log
from detrace.tracefile.layout import CHECKPOINT_LOG_GLOB, NATIVE_CHECK_LOCK, RUNS_DIR, rank_trace_paths
from detrace.tracefile.lock import lock_file
from detrace.tracefile.writer import write_json_atomic

_SKIPPED_DIRS = {".git", "__pycache__", RUNS_DIR}
"""Never CMD's checkpoints: walked past when looking for the files an arm wrote."""
OUTSIDE = "outside-working-directory"
"""Under an arm's folder in OUT: the files its saves named outside the working directory, by their absolute path."""
JOURNAL = "native-journal.json"
"""In OUT: what the check moved where, written before each move; `finished` once everything is back."""
JOURNAL_SCHEMA = "detrace.native-journal/1"
SNAPSHOT = "native-snapshot.json"
"""In OUT: the working directory as it was before the check, per entry [kind, size, inode, mtime_ns]."""

Progress = Callable[[str], None]
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What the user stops a check with: each waits while files move (see _unsignalled)."""


def _stat(path: Path) -> list[object]:
    """[kind, size, inode, mtime_ns] of the entry itself (a link is not followed)."""
    st = os.lstat(path)
    kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
    return [kind, st.st_size, st.st_ino, st.st_mtime_ns]


def take_snapshot(root: Path, out: Path) -> dict[str, list[object]]:
    """Every entry under `root` (not OUT, nor detrace's and git's own folders), by its path relative to `root`.
    Links to folders are followed (a checkpoint folder may be a link to another disk), each folder once."""
    entries: dict[str, list[object]] = {}
    seen: set[tuple[int, int]] = set()
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as listing:
                children = list(listing)
        except OSError:
            continue  # (unreadable: nothing of it can be told apart, and nothing of it is walked later either)
        for child in children:
            path = Path(child.path)
            if child.name in _SKIPPED_DIRS:
                continue
            try:
                is_dir = child.is_dir()
                if is_dir and path.resolve() == out:
                    continue
                entries[str(path.relative_to(root))] = _stat(path)
            except OSError:
                continue
            if is_dir:
                pending.append(path)
    return entries


class NativeContract(Contract):
    """check-resume's arms driven through CMD's own checkpoints (see the module's docstring)."""

    def __init__(self, cmd: list[str], *, out: Path, resume_args: Sequence[str] = (), force: bool = False,
                 root: Path | None = None, at: Sequence[int] = (), progress: Progress = lambda _: None) -> None:
        # Imported here: the package detrace.state imports torch, which the command does not need before it runs.
        from detrace.state.contract import NATIVE_CONTROLS

        super().__init__(cmd)
        self.controls = NATIVE_CONTROLS
        self.root = (root if root is not None else Path.cwd()).resolve()
        self.out = out.resolve()
        self.resume_args = list(resume_args)
        self.force = force
        self.at = sorted(set(at))
        """The stop points: the continuous run must have saved at each (refused after the first arm)."""
        self.progress = progress
        self.aside = self.out / "saved-by-cmd"
        """Where each arm's files go: `saved-by-cmd/<arm>/...` (a stop point's under `at-K/...`)."""
        self.before_check = self.out / "before-check"
        """With --force: the checkpoints that were there before the check."""
        self.snapshot: dict[str, list[object]] | None = None
        """The working directory before the check (see take_snapshot); None until the first arm begins."""
        self.folders: set[Path] = set()
        """The checkpoint folders in the working directory that the arms' saves and loads named so far (the working
        directory itself for a file saved there: then only the files in `named`). Paths as CMD named them (a link
        stays a link: its target may be outside the working directory)."""
        self.named: set[str] = set()
        """The files that a save named in the working directory itself (the only ones there that may move)."""
        self.moved: list[tuple[Path, Path]] = []
        """With --force: (where it was, where it is in OUT) for each of the user's entries moved aside."""
        self.continuous = False
        """Whether the continuous run's files are in OUT to be put back at the end."""
        self.kept: list[str] = []
        """What could not be put back, and where it is (said at the end)."""
        self.stops: dict[Path, int] = {}
        """Each stop point's directory, and its step (for `{K}` in --resume-args)."""
        self.running: Path | None = None
        """The run of the arm under way (its log says what a failed arm saved)."""
        self.rng: dict[Path, dict[str, list[list[object]]]] = {}
        """Per stop point, where the stopped run's saves put RNG states, per file (for the skip-rng control)."""
        self.saved: dict[Path, dict[str, int]] = {}
        """Per stop point, the steps the stopped run had completed at each of its saves, per file or folder: the
        resumed arms number their steps on from the one they load."""
        self.saves: list[CheckpointIO] = []
        """The continuous run's saves (what --at can name)."""
        self.discarded = 0
        """Continuous runs that resumed from a checkpoint that was there before the check."""
        self.in_out: str | None = None
        """A path in OUT that a save or load of CMD named (refused after the arm: OUT is the check's own)."""
        self._lock: int | None = None

    # -- the arms ---------------------------------------------------------------------------------------------

    def before(self, arm: str, run: Path, point: Path | None) -> None:
        with _unsignalled():
            if self.snapshot is None:
                self._begin()
            self.running = run
            if point is not None and arm != "stopped":
                self._copy_back(self._stash(point))  # the stopped arm's checkpoint, as that arm left it

    def after(self, arm: str, run: Path, point: Path | None) -> None:
        with _unsignalled():
            self._after(arm, run, point)

    def _after(self, arm: str, run: Path, point: Path | None) -> None:
        self.running = None
        log = read_checkpoint_log(run)
        self._learn(log)
        if self.in_out is not None:
            raise UsageError(f"--out {self.out} is where CMD keeps its checkpoints ({self.in_out}): the check keeps "
                             "its runs there and moves CMD's checkpoints out of their folders; give --out a folder "
                             "of its own")
        if point is None:  # a continuous arm
            old = self._old_checkpoint(log)
            if old is not None:
                self.discarded += 1  # its files (saved after it resumed) go aside as well, apart from the others
                self._move_aside(self.aside / f"{run.name}-resumed-from-an-old-checkpoint-{self.discarded}", log)
                self._set_aside(run.name, old)
            self._move_aside(self.aside / run.name, log)
            if arm == "continuous":
                self.continuous = True
                self._journal()
                self.saves = [io for io in log if io.op == "save"]
                for k in self.at:  # refused now, not after the stopped arm
                    self._saved_at(k, self.saves)
        elif arm == "stopped":
            self._move_aside(self._stash(point), log)
        else:
            self._move_aside(self.aside / point.name / run.name, log)
            given = f" even with --resume-args {' '.join(self.resume_args)}" if self.resume_args else ""
            if not any(io.op == "load" for io in log):
                raise CommandFailed(f"CMD did not resume{given}: its {run.name} run after step {self.stops[point]} "
                                    "loaded no checkpoint; give --resume-args with the arguments that make it resume "
                                    "(such as --resume-args=--init_from=resume)")
            if not rank_trace_paths(run) and not self._loaded_stopped(log, point):
                # Nothing to compare: its steps were numbered from 0 (no checkpoint of the stopped run's, and no
                # optimizer count, gave it the step) and fell outside the check's window, or it trained none.
                k, saved = self.stops[point], sorted(self._relative(path) for path in self.saved.get(point, {}))
                loaded = sorted({path for io in log if io.op == "load" for path in io.paths}) or ["a buffer"]
                raise CommandFailed(f"CMD did not resume from its checkpoint{given}: its {run.name} run after step "
                                    f"{k} loaded {', '.join(loaded)}, which the run stopped after step {k} "
                                    f"did not save (it saved {', '.join(saved)}), and recorded no step after step "
                                    f"{k}; give --resume-args with the arguments that make it load "
                                    f"{saved[0] if saved else 'that checkpoint'}")

    def stop(self, k: int, point: Path) -> tuple[list[str], dict[str, str]]:
        from detrace.state.contract import ENV_NATIVE_STOP_AT  # see __init__

        self.stops[point] = k
        return self.cmd, {ENV_NATIVE_STOP_AT: str(k)}

    def stopped(self, k: int, run: Path, point: Path) -> None:
        log = read_checkpoint_log(run)
        self.rng[point] = {str(self._absolute(path)): [[kind, list(key_path)] for kind, key_path in io.rng]
                           for io in log if io.op == "save" and io.rng for path in io.paths}
        self.saved[point] = {str(self._absolute(path)): io.completed for io in log if io.op == "save"
                             for path in io.paths}
        if any(io.op == "save" and io.completed == k for io in log):
            return
        self._saved_at(k, self.saves)
        raise CommandFailed(f"CMD's run stopped after step {k} saved no checkpoint at that step, although its "
                            "continuous run did")

    def _saved_at(self, k: int, saves: list[CheckpointIO]) -> None:
        """Refuse a stop point at which the continuous run saved nothing."""
        steps = sorted({io.completed for io in saves})
        if not steps:
            raise CommandFailed("CMD saved no checkpoint (torch.save, safetensors or torch.distributed.checkpoint) in "
                                "its continuous run, so there is nothing of its own to resume from")
        if k not in steps:
            raise UsageError(f"CMD saved no checkpoint after step {k}: its continuous run saved after steps "
                             f"{', '.join(map(str, steps))}; give --at one of them")
        if all(io.in_memory and not io.paths for io in saves if io.completed == k):
            raise UsageError(f"CMD saved its checkpoint after step {k} into memory (torch.save into a buffer) and "
                             "its bytes are in no file under the working directory (uploaded, or written elsewhere), "
                             "so the check cannot keep its arms' checkpoints apart; have CMD write them to a file in "
                             "the working directory for the check")

    def resume(self, point: Path, control: str | None = None) -> tuple[list[str], dict[str, str]]:
        from detrace.state.contract import ENV_NATIVE_CONTROL, ENV_NATIVE_RNG, ENV_NATIVE_SAVED  # see __init__

        env = {ENV_NATIVE_SAVED: json.dumps(self.saved.get(point, {}))}
        if control is not None:
            env[ENV_NATIVE_CONTROL] = control
        if control == "skip-rng":
            env[ENV_NATIVE_RNG] = json.dumps(self.rng.get(point, {}))
        k = str(self.stops.get(point, ""))
        return [*self.cmd, *(arg.replace("{K}", k) for arg in self.resume_args)], env

    def applied(self, control: str, run: Path) -> bool:
        return any(io.op == "load" and io.control == control for io in read_checkpoint_log(run))

    def finish(self) -> None:
        """Put back the checkpoints that were there before the check (with --force), else the first continuous
        run's files; the other arms' stay under OUT. An arm that failed left its files in place: they go aside
        first. The journal is marked finished and the working directory's lock let go."""
        if self.snapshot is None:
            return  # (the check never began: nothing moved, no lock held)
        with _unsignalled():
            try:
                if self.running is not None:
                    log = read_checkpoint_log(self.running) if self.running.is_dir() else []
                    self._learn(log)
                    self._move_aside(self.aside / "unfinished-arm", log)
                self._put_everything_back()
                with contextlib.suppress(OSError):  # (unfinished, the next check only finds nothing left to move)
                    self._journal(finished=True)
            finally:
                self._let_go()
        for line in self.kept:
            self.progress(line)

    def _put_everything_back(self) -> None:
        if self.moved:
            for place, aside in reversed(self.moved):
                self._put_back(aside, place)
        elif self.continuous and (self.aside / "continuous").is_dir():
            source = self.aside / "continuous"
            for child in sorted(source.iterdir()):
                self._put_back(child, self._place(Path(child.name)))

    # -- the check's own state: the lock, the snapshot, the journal -------------------------------------------

    def _begin(self) -> None:
        """Before the first arm: refuse an OUT that CMD writes into, hold the working directory's lock (putting back
        what a killed check left in OUT), then take the snapshot and write the journal."""
        for arg, path in self._arguments():
            if path.resolve() == self.out:
                raise UsageError(f"--out {self.out} is also named by CMD ({arg}): the check keeps its runs there and "
                                 "moves CMD's checkpoints out of their folders; give --out a folder of its own")
        self._hold()
        self.snapshot = take_snapshot(self.root, self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out / SNAPSHOT, {"schema": JOURNAL_SCHEMA, "entries": self.snapshot})
        self._journal()

    def _journal(self, *, finished: bool = False) -> None:
        """Write the journal (before each move: a check killed in the middle leaves what it moved where)."""
        write_json_atomic(self.out / JOURNAL, {
            "schema": JOURNAL_SCHEMA, "root": str(self.root), "pid": os.getpid(), "command": self.cmd,
            "finished": finished, "continuous": self.continuous,
            "folders": sorted(map(str, self.folders)), "named": sorted(self.named),
            "moved": [[str(place), str(aside)] for place, aside in self.moved]})

    @classmethod
    def from_journal(cls, out: Path, progress: Progress = lambda _: None) -> NativeContract | None:
        """The contract of the check whose journal is in `out`, as it was when it stopped; None once it finished."""
        out = out.resolve()
        try:
            journal = json.loads((out / JOURNAL).read_text())
            entries = json.loads((out / SNAPSHOT).read_text())["entries"]
            if journal.get("schema") != JOURNAL_SCHEMA:
                raise ValueError(journal.get("schema"))
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"{out} holds no readable journal of check-resume --native ({JOURNAL} and "
                             f"{SNAPSHOT}), so there is nothing to recover from it") from None
        if journal["finished"]:
            return None
        contract = cls(list(journal["command"]), out=out, root=Path(journal["root"]), progress=progress)
        contract.snapshot = entries
        contract.continuous = bool(journal["continuous"])
        contract.folders = {Path(folder) for folder in journal["folders"]}
        contract.named = set(journal["named"])
        contract.moved = [(Path(place), Path(aside)) for place, aside in journal["moved"]]
        return contract

    def recover(self) -> None:
        """Put back what the killed check moved (the lock is held): the files its unfinished arm left in place go
        aside, then the user's own entries (or the continuous run's files) come back."""
        runs = {log.parent for log in self.out.rglob(CHECKPOINT_LOG_GLOB)
                if not log.is_relative_to(self.aside) and not log.is_relative_to(self.before_check)}
        logs = [io for run in sorted(runs) for io in _read(run)]
        self._learn(logs)
        self._move_aside(self.aside / "unfinished-arm", logs)
        self._put_everything_back()
        self._journal(finished=True)
        back = [str(place) for place, aside in self.moved if not os.path.lexists(aside)]
        self.progress(f"put back what the check-resume --native in {self.out} had moved when it was stopped"
                      f"{' (' + ', '.join(back) + ')' if back else ''}; the files its last arm left went into "
                      f"{self.aside / 'unfinished-arm'}")
        for line in self.kept:
            self.progress(line)

    def _hold(self) -> None:
        """Take the working directory's lock: refuse while another check holds it, and recover a check that was
        killed while it held it (its lock file is still there, unlocked)."""
        folder = self.root / RUNS_DIR
        folder.mkdir(exist_ok=True)
        with _locked(folder / NATIVE_CHECK_LOCK) as (fd, previous):
            if previous is not None:
                raise UsageError(f"another detrace check-resume --native (pid {previous.get('pid', '?')}, --out "
                                 f"{previous.get('out', '?')}) is moving checkpoints in {self.root}; wait for it "
                                 "to end: two checks at once would take each other's files for their own")
            old = _previous(fd)
            if old is not None and Path(old) != self.out:
                with contextlib.suppress(UsageError):  # (a journal that is gone or unreadable: nothing to do)
                    killed = NativeContract.from_journal(Path(old), self.progress)
                    if killed is not None and killed.root == self.root:
                        killed.recover()
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "out": str(self.out)}).encode(), 0)
            self._lock = os.dup(fd)

    def _let_go(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.root / RUNS_DIR / NATIVE_CHECK_LOCK).unlink()
            with contextlib.suppress(OSError):  # (detrace's own folder, made by _hold: gone again when empty)
                (self.root / RUNS_DIR).rmdir()
            os.close(self._lock)
            self._lock = None

    # -- the files --------------------------------------------------------------------------------------------

    def _stash(self, point: Path) -> Path:
        return self.aside / point.name / "stopped"

    def _loaded_stopped(self, log: Sequence[CheckpointIO], point: Path) -> bool:
        """Whether a load in `log` read a checkpoint the run stopped at `point` saved: a file it saved, or a file in
        a folder it saved (a DCP checkpoint), as the tracer's step clock matches them."""
        saved = self.saved.get(point, {})
        return any(str(self._absolute(name)) in saved for io in log if io.op == "load" for path in io.paths
                   for name in (path, os.path.dirname(path)))

    def _relative(self, path: str) -> str:
        """An absolute path as the user names it: relative to the working directory when it is inside."""
        return os.path.relpath(path, self.root) if Path(path).is_relative_to(self.root) else path

    def _absolute(self, path: str | Path) -> Path:
        """The path CMD named, absolute and normalised (an absolute path stays, a link stays a link)."""
        return Path(os.path.normpath(self.root / path))

    def _users(self, path: Path) -> bool:
        """Whether the entry was there before the check and is unchanged since: the user's (a folder or a link:
        the same one; a file: the same size, inode and modification time)."""
        assert self.snapshot is not None
        try:
            before = self.snapshot.get(str(path.relative_to(self.root)))
            now = _stat(path)
        except (ValueError, OSError):
            return False
        if before is None:
            return False
        return now == before if before[0] == "file" else now[0] == before[0] and now[2] == before[2]

    def _learn(self, log: list[CheckpointIO]) -> None:
        """Add the checkpoint folders an arm's saves and loads named in the working directory (by the path named:
        a folder that is a link to another disk is still in it), and the files its saves named there."""
        for io in log:
            for path in io.paths:
                absolute = self._absolute(path)
                if absolute == self.root:
                    continue
                folder = absolute if absolute.is_dir() else absolute.parent  # (a DCP checkpoint is a folder)
                if not folder.is_relative_to(self.root):
                    continue
                if folder.resolve().is_relative_to(self.out):
                    self.in_out = self.in_out or path  # (never walked: the check's own runs are there)
                    continue
                self.folders.add(folder)
                if folder == self.root and io.op == "save":
                    self.named.add(absolute.name)

    def _written(self) -> tuple[list[str], list[str]]:
        """The files the arms wrote in the checkpoint folders (those not in the snapshot, or changed since), and
        the folders, each relative to the working directory: in the working directory itself, only the files a
        save named."""
        files: list[str] = []
        for folder in sorted(self.folders):
            if not folder.is_dir():
                continue
            if folder == self.root:
                files += [name for name in self.named
                          if (self.root / name).is_file() and not self._users(self.root / name)]
                continue
            for top, names, filenames in os.walk(folder):
                here = Path(top)
                names[:] = [n for n in names if n not in _SKIPPED_DIRS and (here / n).resolve() != self.out]
                files += [str((here / n).relative_to(self.root)) for n in filenames
                          if (here / n).is_file() and not self._users(here / n)]
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
        top = self._top(old)
        target = self.before_check / self._name(top)
        self.moved.append((top, target))
        self._journal()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(top, target)
        raise RerunArm(f"moved aside {top}, which CMD's {arm} run resumed from, into {target}")

    def _existed(self, path: str) -> bool:
        """Whether the file or folder was there before the check (in the snapshot; outside the working directory,
        where no snapshot is taken: a continuous run's load of what it did not save itself)."""
        assert self.snapshot is not None
        absolute = self._absolute(path)
        if not absolute.is_relative_to(self.root):
            return os.path.lexists(absolute)
        return str(absolute.relative_to(self.root)) in self.snapshot

    def _top(self, path: str) -> Path:
        """What --force moves aside for a checkpoint that was there before the check: its folder (where CMD looks
        for its latest checkpoint), unless that folder is the working directory or a file system's root, or holds
        CMD's script or another path its arguments name: then the checkpoint itself."""
        absolute = self._absolute(path)
        if absolute.is_dir():
            return absolute  # a DCP checkpoint, or HF's checkpoint-N: a folder of its own
        folder = absolute.parent
        if (folder == self.root or folder == Path(folder.anchor) or self.root.is_relative_to(folder)
                or any(p != folder and p.is_relative_to(folder) and os.path.lexists(p) for _, p in self._arguments())):
            return absolute
        return folder

    def _arguments(self) -> Iterator[tuple[str, Path]]:
        """The paths CMD's arguments may name (an argument, or what follows `=` in it), with the argument."""
        for arg in self.cmd:
            for text in {arg, arg.partition("=")[2]} - {""}:
                if not text.startswith("-") and "\0" not in text:
                    yield arg, self._absolute(text)

    def _move_aside(self, target: Path, log: list[CheckpointIO]) -> None:
        """Move the files the arm wrote into `target` (the new files of the checkpoint folders, and what its saves
        named outside the working directory), and remove the folders the arms made that are empty now."""
        self._journal()  # the folders learned so far: a check killed now still knows where arms wrote
        files, folders = self._written()
        for relative in files:
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.root / relative, destination)
        for relative in sorted(folders, key=len, reverse=True):
            folder = self.root / relative
            while (folder != self.root and folder.is_dir() and not folder.is_symlink() and not self._users(folder)
                   and not any(folder.iterdir())):
                folder.rmdir()  # a folder an arm made, empty now: the files put back make it again
                folder = folder.parent
        for io in log:
            for path in io.paths:
                absolute = self._absolute(path)
                if io.op == "save" and not absolute.is_relative_to(self.root) and os.path.lexists(absolute):
                    destination = target / self._name(absolute)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(absolute, destination)

    def _copy_back(self, stash: Path) -> None:
        for source in sorted(p for p in stash.rglob("*") if p.is_file()):
            destination = self._place(source.relative_to(stash))
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)

    def _put_back(self, source: Path, destination: Path) -> None:
        """Move `source` (in OUT) back to `destination`, whatever it is (a file, a folder, a link); into a folder
        that is there again, entry by entry. What finds its place taken stays in OUT, and is said."""
        if not os.path.lexists(source):
            return  # (put back already: a recovery after an earlier one)
        if not os.path.lexists(destination):
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, destination)
        elif source.is_dir() and not source.is_symlink() and destination.is_dir():
            for child in sorted(source.iterdir()):
                self._put_back(child, destination / child.name)
            with contextlib.suppress(OSError):
                source.rmdir()
        else:
            self.kept.append(f"{source} was not put back: {destination} is there again")

    def _name(self, path: Path) -> Path:
        """Where `path` goes under an arm's folder in OUT: its place in the working directory, or `OUTSIDE/...`."""
        absolute = self._absolute(path)
        if absolute.is_relative_to(self.root):
            return absolute.relative_to(self.root)
        return Path(OUTSIDE, *absolute.parts[1:])

    def _place(self, name: Path) -> Path:
        """The inverse of `_name`."""
        if name.parts[0] == OUTSIDE:
            return Path("/", *name.parts[1:])
        return self.root / name


@contextlib.contextmanager
def _unsignalled() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait for the end of the block (then come, and stop the check as they would):
    files are never left half moved, half put back, by a second Ctrl-C or a terminal closing. (The handlers are
    swapped, not the signal mask: a mask is per thread, and torch's threads would take the signal instead.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # (only the main thread may set a handler: no signal handler runs elsewhere either)
        return
    pending: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # (None: set outside Python, cannot be set back from it)
                signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])


def _read(run: Path) -> list[CheckpointIO]:
    try:
        return read_checkpoint_log(run)
    except TraceError:  # a log torn by the kill: the journal knows the folders of the arms before it
        return []


def _previous(fd: int) -> str | None:
    """The OUT named in a lock file (a check that held it and is gone), or None."""
    text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    try:
        out = json.loads(text)["out"] if text.strip() else None
    except (ValueError, KeyError, TypeError):
        return None
    return out if isinstance(out, str) else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[tuple[int, dict[str, object] | None]]:
    """Open and flock `path`: (fd, None) when this process holds it now, (fd, what the holder wrote) when another
    live process does. The fd is closed after the block (hold it longer with os.dup)."""
    fd, held = lock_file(path)
    try:
        if held:
            yield fd, None
            return
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
        except ValueError:
            holder = {}
        yield fd, holder if isinstance(holder, dict) else {}
    finally:
        os.close(fd)


def stopped_check(root: Path) -> Path | None:
    """The OUT of a check-resume --native that was stopped in `root` (killed) before it put back what it moved,
    or None (none was, or it still runs)."""
    path = root / RUNS_DIR / NATIVE_CHECK_LOCK
    if not path.is_file():
        return None
    with _locked(path) as (fd, holder):
        old = _previous(fd) if holder is None else None
    try:
        finished = old is None or json.loads((Path(old) / JOURNAL).read_text())["finished"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if finished else Path(str(old))


def recover(out: Path, progress: Progress) -> None:
    """`check-resume --recover OUT`: put back what the check-resume --native that wrote OUT had moved, when it was
    killed before it could; refused while that check still runs."""
    contract = NativeContract.from_journal(out, progress)
    if contract is None:
        progress(f"nothing to recover: the check-resume --native in {out.resolve()} finished and put back what it "
                 "had moved")
        return
    folder = contract.root / RUNS_DIR
    folder.mkdir(exist_ok=True)
    with _locked(folder / NATIVE_CHECK_LOCK) as (fd, holder):
        if holder is not None:
            raise UsageError(f"the check-resume --native in {contract.out} still runs (pid {holder.get('pid', '?')}); "
                             "it puts back what it moved as it ends")
        contract.recover()
        if _previous(fd) == str(contract.out):  # (else the lock file names another killed check: kept for it)
            with contextlib.suppress(OSError):
                (folder / NATIVE_CHECK_LOCK).unlink()
