"""Running one function per rank on every core, for runs with many ranks.

Processes are started with "spawn", never "fork": the caller may hold threads (PyTorch's, pyarrow's) that a
forked child would inherit in an unknown state. Like any `multiprocessing` user, a script that calls
`detrace.diff` on a large run must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_BYTES = 64 << 20
"""Below this much trace data a single process finishes before a pool of spawned workers has started."""


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def default_workers(tasks: int, trace_bytes: int) -> int:
    """One worker per core for large multi-rank work, else run in this process."""
    if tasks < 2 or trace_bytes < PARALLEL_BYTES:
        return 1
    return min(cores(), tasks)


def map_ranks(fn: Callable[[T], R], tasks: Sequence[T], *, workers: int) -> list[R]:
    """`[fn(t) for t in tasks]`, on `workers` processes when more than one (`fn` must be a module-level function)."""
    if workers <= 1 or len(tasks) <= 1:
        return [fn(task) for task in tasks]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(fn, tasks, chunksize=max(1, len(tasks) // (workers * 8))))
