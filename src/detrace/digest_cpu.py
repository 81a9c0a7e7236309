"""The `detrace-fp1` kernel on the CPU, in numba: the same bits as the eager and compiled kernels of
`detrace.digest`, from the first call of a process.

torch.compile's CPU kernel is fast once built, but building it costs seconds (14.5 s cold, 4.2 s from a warm
Inductor cache) and the eager kernel is several times slower than `torch.hash_tensor`. This kernel is a plain
loop over 64-bit words that numba compiles once per machine and caches on disk (`cache=True`): a fresh
process loads it in milliseconds. The rows are split over `torch.get_num_threads()` Python threads (the loop
releases the GIL), so no threading layer of numba's own is started in the traced process.

Loading starts in a background thread when `detrace.digest` is imported (importing numba alone takes about a
second). The first call that needs the kernel waits for it at most `FIRST_WAIT` seconds, then falls back to
NumPy until it is ready: no traced step ever waits longer for a compile (the first compile on a
machine takes a few seconds more).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_SHIFT = np.uint64(33)
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
FIRST_WAIT = 1.0
"""Seconds the first call that needs the kernel may wait for it to load."""
# Below this many words per thread, one more thread costs more than it saves.
_MIN_WORDS_PER_THREAD = 1 << 16


def _row_sums_py(words: np.ndarray, rowkeys: np.ndarray, colkeys: np.ndarray, out: np.ndarray,
                 start: int, stop: int) -> None:
    """out[r] = sum over c of mix(words[r, c] ^ colkeys[c] ^ rowkeys[r]) mod 2**64, for start <= r < stop."""
    width = words.shape[1]
    for r in range(start, stop):
        rk = rowkeys[r]
        acc = np.uint64(0)
        for c in range(width):
            x = words[r, c] ^ colkeys[c] ^ rk
            x ^= x >> _SHIFT
            x *= _C1
            x ^= x >> _SHIFT
            x *= _C2
            x ^= x >> _SHIFT
            acc += x
        out[r] = acc


class _Kernel:
    """The compiled kernel, loaded (or compiled and cached) once, in a background thread."""

    def __init__(self) -> None:
        self.fn: Callable[..., None] | None = None
        self.failed: str | None = None if importlib.util.find_spec("numba") else "numba is not installed"
        self._thread: tuple[int, threading.Thread] | None = None
        self._waited = False
        self._lock = threading.Lock()
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    @property
    def usable(self) -> bool:
        """Whether the kernel is loaded or may still load (else the caller's other kernels apply)."""
        return self.failed is None

    def start(self) -> None:
        """Load or compile the kernel in a background thread (once per process; a forked child starts anew)."""
        with self._lock:
            if self.failed is not None or self.fn is not None or (self._thread and self._thread[0] == os.getpid()):
                return
            thread = threading.Thread(target=self._load, name="detrace-fp-kernel", daemon=True)
            self._thread = (os.getpid(), thread)
        thread.start()

    def _load(self) -> None:
        try:
            import numba

            fn = numba.njit(nogil=True, cache=True)(_row_sums_py)
            probe = np.arange(8, dtype=np.uint64).reshape(1, 8)
            fn(probe, np.zeros(1, np.uint64), np.zeros(8, np.uint64), np.empty(1, np.uint64), 0, 1)
            self.fn = fn
        except Exception as err:  # any failure leaves the eager kernel in charge
            self.failed = f"{type(err).__name__}: {err}"

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        # A pool made before a fork has no threads in the child: one pool per process.
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(max_workers=threads, thread_name_prefix="detrace-fp"))
        return self._pool[1]

    def row_sums(self, words: np.ndarray, rowkeys: np.ndarray, colkeys: np.ndarray, threads: int, *,
                 wait: float | None) -> np.ndarray | None:
        """Per-row sums (uint64 [N]) of words [N, W] (uint64), or None while the kernel is not loaded. Only the
        first call waits for the load, at most `wait` seconds (None: until it is done)."""
        fn = self.fn
        if fn is None:
            self.start()
            if (not self._waited or wait is None) and self._thread is not None:
                self._waited = True
                self._thread[1].join(wait)
            fn = self.fn
            if fn is None:
                return None
        rows = words.shape[0]
        out = np.empty(rows, dtype=np.uint64)
        threads = max(1, min(threads, words.size // _MIN_WORDS_PER_THREAD, rows))
        if threads == 1:
            fn(words, rowkeys, colkeys, out, 0, rows)
            return out
        bounds = [rows * i // threads for i in range(threads + 1)]
        pool = self._executor(threads)
        futures = [pool.submit(fn, words, rowkeys, colkeys, out, bounds[i], bounds[i + 1])
                   for i in range(1, threads)]
        fn(words, rowkeys, colkeys, out, bounds[0], bounds[1])
        for future in futures:
            future.result()
        return out


kernel = _Kernel()
