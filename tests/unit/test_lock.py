"""The flock-held lock files: `lock_file`, which the run directory's lock and check-resume --native's share."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from detrace.errors import TraceError
from detrace.tracefile import lock
from detrace.tracefile.lock import RUN_LOCK, lock_file, writing


def test_lock_file_holds_a_free_file_and_reports_a_held_one(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    fd, held = lock_file(path)  # created
    assert held and path.is_file()
    # flock belongs to the open file: a second open in this process is another holder, as another process is
    other, other_held = lock_file(path)
    os.close(other)
    assert not other_held
    os.close(fd)  # let go: the next one holds it
    again, again_held = lock_file(path)
    os.close(again)
    assert again_held


def test_lock_file_opens_again_when_the_holder_removed_the_file(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder letting go removes the file before its lock falls: a lock taken on the removed file guards
    nothing, so lock_file locks the file now at the path instead."""
    path = tmp_path / "x.lock"
    path.write_text("old holder\n")
    real_flock = fcntl.flock
    calls: list[int] = []

    def flock_after_removal(fd: int, operation: int) -> None:
        if not calls:
            path.unlink()  # the holder's last act, between our open and our flock
        calls.append(fd)
        real_flock(fd, operation)

    monkeypatch.setattr(lock.fcntl, "flock", flock_after_removal)
    fd, held = lock_file(path)
    try:
        assert held and len(calls) == 2
        assert os.fstat(fd).st_ino == os.stat(path).st_ino and path.read_text() == ""
    finally:
        os.close(fd)


def test_writing_refuses_a_directory_that_a_live_run_writes(tmp_path: Path) -> None:
    with writing(tmp_path):
        assert (tmp_path / RUN_LOCK).read_text() == f"{os.getpid()}\n"
        with pytest.raises(TraceError, match=rf"being written by another detrace run that still runs \(pid "
                                             rf"{os.getpid()}\)"), writing(tmp_path):
            pass
    assert not (tmp_path / RUN_LOCK).exists()
    with writing(tmp_path):  # let go: the next run takes it
        pass


def test_writing_says_why_it_cannot_create_the_lock(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot write to output directory"), writing(tmp_path / "missing"):
        pass
