"""A checkpoint root's versions: their names, `latest`, the atomic commit of a save, and the writers' locks.

    root/latest                  the name of the current version, replaced atomically (os.replace)
    root/step-00000012/          one complete version (step-00000012.N: that step saved again, e.g. by a rerun)
    root/.tmp-TOKEN/             a save in progress: invisible until committed
    root/.tmp-TOKEN.lock         its lock, held (flock) by the saving job's rank 0 while the save is in progress

Rank 0 writes the manifest last, renames the temporary directory into place and only then repoints `latest`. A
crash at any moment leaves `latest` naming the previous, complete version; the half-written one is never read and
is removed by the next save, once its writer's lock is free: two jobs may save into one root without one removing
the other's save in progress. What goes into a version, and which rank writes what: `detrace.state.checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

from detrace.errors import CheckpointError, os_error_text
from detrace.state import manifest
from detrace.state.storage import read_json, write_json

LATEST_FILE = "latest"
_VERSION = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_TMP_PREFIX = ".tmp-"
_LATEST_LIMIT = 64
"""The most bytes a version name in `latest` takes (step-NNNNNNNN.K and a newline, with room to spare)."""
_LATEST_SHOWN = 32
"""How much of a `latest` that names no version an error quotes."""


def resolve(path: Path) -> Path:
    """The version directory that `path` (a checkpoint root or a version directory) designates."""
    if (path / manifest.MANIFEST_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        return path / _latest_name(latest)
    if not path.exists():
        raise CheckpointError(f"there is no checkpoint at {path}")
    raise CheckpointError(f"{path} is not a detrace checkpoint (no {manifest.MANIFEST_FILE}, no {LATEST_FILE})")


def _latest_name(latest: Path) -> str:
    """The version `latest` names. Whatever else it holds (bytes that are not text, another file it links to) is
    quoted by a short prefix, its unprintable characters escaped: never the whole file."""
    try:
        with latest.open("rb") as handle:
            raw = handle.read(_LATEST_LIMIT + 1)
    except OSError as err:
        raise CheckpointError(f"cannot read {latest}: {err.strerror or err}") from None
    name = raw.decode("ascii", errors="replace").strip()
    if len(raw) <= _LATEST_LIMIT and _VERSION.fullmatch(name):
        return name
    shown = raw[:_LATEST_SHOWN].decode("utf-8", errors="replace")
    raise CheckpointError(f"{latest} does not name a checkpoint version (it holds {shown!r}"
                          f"{'...' if len(raw) > _LATEST_SHOWN else ''})")


def commit(root: Path, tmp: Path, *, step: int, world: int, keep: int) -> int:
    """Make the version in `tmp` the current one; returns its name's suffix (see `version_name`)."""
    records = [record for rank in range(world) for record in read_json(tmp / fingerprint_file(rank))]
    for rank in range(world):
        (tmp / fingerprint_file(rank)).unlink()
    files = [path for path in tmp.iterdir() if path.suffix == ".json"]
    write_json(tmp / manifest.MANIFEST_FILE, manifest.build(step=step, world_size=world, records=records, files=files,
                                                            command=_traced_command()))
    _fsync_dir(tmp)
    suffix = _free_suffix(root, step)
    while True:
        try:
            os.rename(tmp, root / version_name(step, suffix))
            break
        except OSError as err:  # another job committed that name since: the next free one
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            suffix = _free_suffix(root, step)
    name = version_name(step, suffix)
    _fsync_dir(root)
    # The version becomes the current one only now, in one atomic step.
    pointer = tmp.with_name(f"{tmp.name}.{LATEST_FILE}")
    pointer.write_text(name + "\n")
    with pointer.open("rb") as stream:
        os.fsync(stream.fileno())
    os.replace(pointer, root / LATEST_FILE)
    _fsync_dir(root)
    _remove_old(root, current=name, keep=keep)
    return suffix


def prepare_root(root: Path) -> None:
    """Create the checkpoint root, or say in one sentence why it cannot be one (before any rank writes)."""
    blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if blocker == root:
        raise CheckpointError(f"checkpoint directory {root} is a file, not a directory")
    if blocker is not None:
        raise CheckpointError(f"checkpoint directory {root} cannot be created: {blocker} is a file")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"checkpoint directory {root} cannot be created: {err.strerror or err}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {root} is not writable")


def _traced_command() -> tuple[str, ...] | None:
    """The command of the traced run this process belongs to (what its run.json names), or None."""
    from detrace.errors import UsageError
    from detrace.record.config import TraceConfig

    try:
        config = TraceConfig.from_env()
    except UsageError:  # not a tracer's configuration: no run to name
        return None
    return None if config is None else config.command


def version_name(step: int, suffix: int) -> str:
    """`step-00000012`, or `step-00000012.N` (suffix N) when that step was saved before (e.g. by a rerun)."""
    return f"step-{step:08d}" + (f".{suffix}" if suffix else "")


def _free_suffix(root: Path, step: int) -> int:
    suffix = 0
    while (root / version_name(step, suffix)).exists():
        suffix += 1
    return suffix


_WRITER = re.compile(rf"{re.escape(_TMP_PREFIX)}([0-9a-f]{{16}})(?:\.lock|\.{LATEST_FILE})?")
"""A writer's entries: its temporary directory, its lock file and its pointer file."""


def writer_entry(token: int, suffix: str = "") -> str:
    return f"{_TMP_PREFIX}{token:016x}{suffix}"


class Writer:
    """The lock of one save into a checkpoint root, held by rank 0 of the saving job.

    Its temporary entries (`.tmp-TOKEN/`, `.tmp-TOKEN.latest`) exist only while `.tmp-TOKEN.lock` exists and is
    locked (flock) by the writer: the lock is taken before they are made and removed after they are gone. An
    entry whose lock is free (the kernel frees it when its process dies) or missing was left by a dead writer,
    and only such entries are removed, once this writer holds its own lock."""

    def __init__(self, root: Path) -> None:
        while True:
            self.token = secrets.randbits(64)
            self.path = root / writer_entry(self.token, ".lock")
            try:
                self.stream = self.path.open("a")
            except OSError as err:
                raise CheckpointError(f"cannot lock a save into {root}: {os_error_text(err, root)}") from None
            fcntl.flock(self.stream, fcntl.LOCK_EX)
            # A clean-up may have judged the file stale between its creation and the lock: then it is gone.
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(self.stream.fileno()), self.path.stat()):
                    break
            self.stream.close()
        _remove_stale(root, own=self.token)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.stream.close()


def _remove_stale(root: Path, *, own: int) -> None:
    """Remove what dead writers left behind (temporary directories and pointer files), never a live writer's."""
    writers = set()
    for path in root.iterdir():
        if not path.name.startswith(_TMP_PREFIX):
            continue
        match = _WRITER.fullmatch(path.name)
        if match is None:  # an older detrace's entry, which took no lock
            _remove(path)
        else:
            writers.add(int(match.group(1), 16))
    for token in writers - {own}:
        _remove_if_dead(root, token)


def _remove_if_dead(root: Path, token: int) -> None:
    """Remove writer `token`'s entries when its lock is free or missing (its process is gone)."""
    lock = root / writer_entry(token, ".lock")
    try:
        stream = lock.open("r")
    except FileNotFoundError:
        stream = None
    try:
        if stream is not None:
            try:
                fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a live writer
        for suffix in ("", f".{LATEST_FILE}"):
            _remove(root / writer_entry(token, suffix))
        if stream is not None:
            lock.unlink(missing_ok=True)
    finally:
        if stream is not None:
            stream.close()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_old(root: Path, *, current: str, keep: int) -> None:
    """Keep the `keep` most recently committed versions, the current one always among them."""
    versions = [
        path for path in root.iterdir()
        if _VERSION.fullmatch(path.name) and path.name != current and (path / manifest.MANIFEST_FILE).is_file()
    ]
    versions.sort(key=lambda path: (path / manifest.MANIFEST_FILE).stat().st_mtime_ns, reverse=True)
    for path in versions[keep - 1 :]:
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fingerprint_file(rank: int) -> str:
    return f"fingerprints-rank-{rank}.json"
