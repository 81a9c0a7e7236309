"""Two (or more) real gloo ranks in spawned processes, for tests whose ranks are functions of a test module."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing


def free_port() -> int:
    """A TCP port that was free a moment ago, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], *, nprocs: int = 2, timeout: float) -> None:
    """Run fn(rank, *args, port) on `nprocs` spawned ranks; kill them all and fail if they take over `timeout` s
    (a rank left waiting in a collective must not hang the suite)."""
    context = torch.multiprocessing.start_processes(fn, args=(*args, free_port()), nprocs=nprocs, join=False,
                                                    start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the ranks hung")
