"""The watchdog of `detrace run`: kills CMD's whole process tree if the launcher dies.

A small process of its own (own session, so a Ctrl-C at the terminal does not end it) that reads its stdin, a pipe
whose only write end the launcher holds. A byte means CMD ended: it exits. End of file without a byte means the
launcher died (SIGKILL, SIGTERM, a crash: the kernel closes its pipe) or is killing CMD: it kills CMD's whole tree
with SIGKILL. CMD's process group is not enough: torchrun starts each worker in a session of its own, and a
SIGKILLed torchrun leaves them running (they get no death signal). So the tree is found by parent pid in /proc
while it is intact, each process stopped first so that none can fork unseen, then all are killed, then CMD's
process group (for anything already orphaned in it). A death signal (prctl PR_SET_PDEATHSIG) on CMD would kill CMD
first and leave its orphaned workers no longer traceable to it. CMD's identity is its start time, so a pid reused
after CMD ended is never touched.

The launcher runs this file by its path with `python -I -S` (see `detrace.launch.launcher`): no site, so the
tracer's sitecustomize (on CMD's PYTHONPATH) is not loaded, and no package import, so it starts in milliseconds.
It therefore imports nothing but the standard library.

    python -I -S watchdog.py CMD_PID
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process in /proc."""
    tree: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        fields = _stat(int(name)) if name.isdigit() else None
        if fields:
            tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def _send(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def _start_time(pid: int) -> bytes | None:
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def main(argv: list[str]) -> int:
    cmd = int(argv[0])
    proc = os.path.isdir("/proc")  # without it (not Linux): CMD's process group only
    born = _start_time(cmd)
    if sys.stdin.buffer.read(1) or (proc and (born is None or _start_time(cmd) != born)):
        return 0
    stopped: set[int] = set()
    todo = [cmd] if proc else []
    while todo:
        for pid in todo:
            _send(pid, signal.SIGSTOP)
            stopped.add(pid)
        tree = _children()
        todo = [child for pid in stopped for child in tree.get(pid, ()) if child not in stopped]
    for pid in stopped:
        _send(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(cmd, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
