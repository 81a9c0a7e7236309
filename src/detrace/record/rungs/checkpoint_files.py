"""Where a program's checkpoint saves end up, when that is not the file the save named (for
detrace.record.rungs.checkpoints, whose log it writes into).

- Renamed: careful code saves to a temporary file and renames it (`torch.save(obj, tmp); os.replace(tmp, final)`,
  also `os.rename`, `shutil.move`, `Path.replace` / `Path.rename`, which call them). A rename of a file or folder a
  save of this process named (or of a folder holding one) is logged as a "rename" line: the saves' paths, as they
  were logged, and where they are now. The reader (detrace.tracefile.checkpoints) follows it, so a save names the
  file a later load reads.
- Saved into memory: `torch.save` into a buffer (`io.BytesIO`) whose bytes the program then writes to a file, or
  uploads. The save is logged with a number of its own ("memory") and the digest of the bytes it wrote is kept; as
  the next optimizer step begins, and as the process ends, the files written since under the working directory (and
  the folders its other checkpoints named) whose size matches are read, and one with the same bytes is logged as a
  "landed" line of that save. A save whose bytes are found in no file stays a save into memory with no path.
  A load from a buffer is matched the same way against the files of check-resume --native's stopped run
  (`Files.known`): it then names that file, so that the negative controls and the step count apply to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from detrace.tracefile.layout import RUNS_DIR

Write = Callable[[dict[str, Any]], None]

_WALKED = 20_000
"""The most files and folders looked at per search for a save's bytes: a program started from a home folder must not
pay for a walk of all of it."""
_SKIPPED = {"__pycache__", "node_modules", "site-packages", RUNS_DIR}
"""Folders never searched (besides hidden ones): no checkpoint is written there."""
_SLACK_NS = 2_000_000_000
"""A file's modification time may be rounded down by its file system (to 2 s on FAT): a file modified up to this much
before a save may still hold its bytes."""
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class _Pending:
    """A save into memory whose bytes were not found in a file yet."""

    memory: int
    """The save's number among this process's saves into memory (its log line's "memory")."""
    size: int
    digest: bytes
    since: int
    """time.time_ns() as the save returned: the file its bytes land in is written after."""
    looked: bool = False
    """Searched for once already (as the next optimizer step began): searched again only as the process ends."""


def _file_digest(path: str) -> bytes | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return None
    return digest.digest()


def bytes_of(target: Any, start: int | None = None) -> tuple[int, bytes] | None:
    """The size and digest of what an in-memory buffer holds from `start` on (by default its position: what a load
    reads), or None for anything but such a buffer."""
    getbuffer = getattr(target, "getbuffer", None)
    if not callable(getbuffer):
        return None
    try:
        start = target.tell() if start is None else start
        # Both views released before the program touches the buffer again: a live view forbids resizing it.
        with getbuffer() as view, view[start:] as rest:
            return len(rest), hashlib.sha256(rest).digest()
    except (AttributeError, ValueError, TypeError, OSError, BufferError):
        return None


def matching(files: Iterator[str] | list[str], size: int, digest: bytes, since: int | None = None) -> str | None:
    """The first of `files` that holds exactly those bytes (and was modified at or after `since`)."""
    for path in files:
        if _sized(path, {size}, since) and _file_digest(path) == digest:
            return os.path.abspath(path)
    return None


def position(target: Any) -> int | None:
    """Where a save starts writing into an in-memory buffer; None for anything else."""
    try:
        return target.tell() if callable(getattr(target, "getbuffer", None)) else None
    except (AttributeError, ValueError, OSError):
        return None


class Files:
    """Follows this process's saved files through renames, and its saves into memory to the files their bytes land
    in; writes what it finds with `write` (the checkpoint log's)."""

    def __init__(self, write: Write, out: str) -> None:
        self.write = write
        self.out = os.path.abspath(out)
        """The trace's folder: never searched."""
        self.saved: dict[str, str] = {}
        """Every file or folder a save of this process named, by absolute path: the path as the log has it now."""
        self.folders: set[str] = set()
        """The folders holding what this process's checkpoints named: searched for a save's bytes as well."""
        self.pending: list[_Pending] = []
        self.memory = 0
        """Saves into memory so far."""
        self.known: list[str] = []
        """The files of another run that this process may load (check-resume --native's stopped run): a load from
        memory whose bytes one of them holds names it."""

    def named(self, op: str, paths: list[str]) -> None:
        """A save or load named `paths` (as logged)."""
        for path in paths:
            absolute = os.path.abspath(path)
            self.folders.add(os.path.dirname(absolute))
            if op == "save":
                self.saved[absolute] = path

    def known_file(self, size: int, digest: bytes) -> list[str]:
        """The known file that holds the bytes a load read from memory, if any."""
        found = matching(self.known, size, digest)
        return [] if found is None else [found]

    def into_memory(self, target: Any, start: int) -> int | None:
        """A save wrote into `target` from `start` on: its number, when `target` is an in-memory buffer (its bytes
        are looked for in files later), else None."""
        written = bytes_of(target, start)
        if written is None:
            return None
        self.memory += 1
        self.pending.append(_Pending(memory=self.memory, size=written[0], digest=written[1], since=time.time_ns()))
        return self.memory

    def renamed(self, api: str, source: Any, destination: Any) -> None:
        """`source` was renamed to `destination`: log where the saves under it are now."""
        if not self.saved or not isinstance(source, str | os.PathLike) or not isinstance(destination,
                                                                                          str | os.PathLike):
            return
        old, new = os.fspath(source), os.fspath(destination)
        if not isinstance(old, str) or not isinstance(new, str):
            return
        old = os.path.abspath(old)
        moved = {absolute: new + absolute[len(old):] for absolute in tuple(self.saved)  # (another thread may save)
                 if absolute == old or absolute.startswith(old + os.sep)}
        if not moved:
            return
        self.write({"op": "rename", "api": api, "from": [self.saved[absolute] for absolute in moved],
                    "paths": list(moved.values()), "pid": os.getpid()})
        for absolute, path in moved.items():
            self.saved.pop(absolute, None)
            self.named("save", [path])

    def land(self, *, final: bool = False) -> None:
        """Look for the bytes of the saves into memory in the files written since: of the saves not looked for yet,
        or with `final` (the process ends) of every one not found."""
        searched = [pending for pending in self.pending if final or not pending.looked]
        if not searched:
            return
        sizes = {pending.size for pending in searched}
        since = min(pending.since for pending in searched)
        try:
            candidates = [path for path in self._files() if _sized(path, sizes, since)]
        except OSError:  # (the working directory is gone): the training goes on, the saves stay unplaced
            return
        for pending in searched:
            self.pending.remove(pending)
            found = matching(candidates, pending.size, pending.digest, pending.since)
            if found is None:
                self.pending.append(dataclasses.replace(pending, looked=True))
                continue
            self.write({"op": "landed", "memory": pending.memory, "paths": [found], "pid": os.getpid()})
            self.named("save", [found])

    def _files(self) -> Iterator[str]:
        """The files under the working directory and the checkpoints' folders, at most `_WALKED` entries."""
        seen = 0
        here = os.getcwd()
        outside = sorted(f for f in self.folders if f != here and not f.startswith(here + os.sep))
        for root in [here, *outside]:
            for top, names, files in os.walk(root):
                names[:] = [n for n in names if not n.startswith(".") and n not in _SKIPPED
                            and os.path.join(top, n) != self.out]
                seen += len(names) + len(files)
                yield from (os.path.join(top, name) for name in files)
                if seen > _WALKED:
                    return


def _sized(path: str, sizes: set[int], since: int | None) -> bool:
    """Whether `path` is a file of one of those sizes, modified at or after `since` (any time when None)."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return stat.st_size in sizes and (since is None or stat.st_mtime_ns >= since - _SLACK_NS)
