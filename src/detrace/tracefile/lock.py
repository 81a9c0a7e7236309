"""The lock a `detrace run` holds on its run directory while it writes it.

`run.lock` in the run directory, held with flock by the launcher from before it clears the directory until run.json
is finished, with the launcher's pid inside. The kernel drops the lock when the launcher's process ends, however it
ends (SIGKILL too), so the lock tells a live writer from a dead one: a second `detrace run` (even with --force) never
replaces a directory that a live run still writes, and a run.json left "running" by a writer that was killed is
reported as such. The launcher removes the file as it lets go; one left behind, unlocked, is a writer that died.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from detrace.errors import TraceError, os_error_text

RUN_LOCK = "run.lock"


def _pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None


def lock_file(path: Path) -> tuple[int, bool]:
    """Open `path` (created if missing) and flock it exclusively without waiting: (fd, True) when this process
    holds the lock now, (fd, False) when another live process does (the caller reads what the holder wrote). The
    caller closes fd. OSError when the file cannot be opened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return fd, False
        # The file locked must still be the one at the path: a holder letting go removes it before its lock
        # falls, so a file opened before that removal and locked after it guards nothing (the next process
        # creates a new one at the path): open again.
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd, True
        os.close(fd)


@contextlib.contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block (the directory exists); TraceError when a live run holds it."""
    path = run_dir / RUN_LOCK
    try:
        fd, held = lock_file(path)
    except OSError as err:  # a read-only directory, a full disk
        raise TraceError(f"cannot write to output directory {run_dir}: {os_error_text(err, run_dir)}") from None
    if not held:
        pid = _pid(fd)
        os.close(fd)
        raise TraceError(f"{run_dir} is being written by another detrace run that still runs"
                         f"{f' (pid {pid})' if pid else ''}; wait for it to end or choose another "
                         "directory (--force never replaces a live run's trace)")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def dead_writer(run_dir: Path) -> str | None:
    """Why the writer of a run whose run.json says "running" no longer runs (a clause), or None while it does."""
    path = run_dir / RUN_LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "no detrace run holds its lock"
    except OSError:
        return None  # cannot tell: say nothing beyond what run.json says
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live writer holds it
        pid = _pid(fd)
    finally:
        os.close(fd)
    gone = pid is not None and not _runs(pid)
    return f"{f'pid {pid} is gone and ' if gone else ''}its lock is free"


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
