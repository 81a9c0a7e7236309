"""The CPU kernels of `detrace-fp1` and `detrace-fp2`: the same bits as the eager and compiled kernels of
`detrace.digest.kernels`, at full speed from the first call of a process.

torch.compile's CPU kernel is fast once built, but building it costs seconds (14.5 s cold, 4.2 s from a warm
Inductor cache), a JIT such as numba costs most of a second to import and load in every fresh process, and the
eager kernel is several times slower than `torch.hash_tensor`. Each kernel is a plain loop in C (`_fp1.c` over
64-bit words, `_fp2.c` over 32-bit lanes that the compiler vectorizes), compiled when detrace is installed:
importing it takes microseconds. The rows are split over `torch.get_num_threads()` Python threads (the loop
releases the GIL), so no threading layer of its own is started in the traced process.

The extensions are optional (setup.py): where one was not built (or was built from an older detrace), its `usable`
is False and `detrace.digest` hashes on the CPU with NumPy and eager kernels instead.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np

from detrace.digest.scheme import ROW_BYTES, SCHEME, SCHEME2, add

_T = TypeVar("_T")

# Below this many words per thread, one more thread costs more than it saves.
_MIN_WORDS_PER_THREAD = 1 << 16


class _Kernel:
    """The compiled kernel, when the extension was built, and the threads that share its rows."""

    def __init__(self, module: str, scheme: str) -> None:
        self.scheme = scheme
        self.fn: Callable[..., None] | None = None
        self.fn_total: Callable[..., int] | None = None
        self.fn_total_at: Callable[..., int] | None = None
        self._catch: Callable[[bool], None] | None = None
        self.failed: str | None = None
        self.build = ""
        """Where the kernel was built: its loop's vector path on this CPU and the compiler (for `detrace doctor`)."""
        try:
            loaded = importlib.import_module(module)
            # all or none: a build older than this source lacks some, and then none may be used
            self.fn, self.fn_total, self.fn_total_at, self._catch = (loaded.row_sums, loaded.total, loaded.total_at,
                                                                     loaded.catch_bus_errors)
            self.build = (f"{getattr(loaded, 'VECTOR_PATH', 'unknown')} path, built by "
                          f"{getattr(loaded, 'COMPILER', 'an unknown compiler')}")
        except (ImportError, AttributeError) as err:  # AttributeError: a build older than this source
            self.failed = f"the C extension {module} was not built at install ({err})"
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    @property
    def usable(self) -> bool:
        """Whether the kernel is there (else the caller's other kernels apply)."""
        return self.fn is not None

    @contextlib.contextmanager
    def bus_errors_caught(self) -> Iterator[None]:
        """Within the block, a SIGBUS while the kernel reads its words (a mapped file that another process
        truncated) makes that call raise OSError(EFAULT), rather than end the process with no sentence. Every other
        SIGBUS goes on to the handler there was, which is back in place after the block (the C module's comment
        says why it is not left installed)."""
        catch = self._catch
        if catch is None:
            yield
            return
        catch(True)
        try:
            yield
        finally:
            catch(False)

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        # A pool made before a fork has no threads in the child: one pool per process.
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(max_workers=threads, thread_name_prefix="detrace-fp"))
        return self._pool[1]

    def row_sums(self, words: np.ndarray, rowkeys: np.ndarray, colkeys: np.ndarray, threads: int) -> np.ndarray:
        """Per-row sums (uint64 [N]) of words [N, W] (uint64 for fp1, uint32 for fp2)."""
        fn = self.fn
        if fn is None:
            raise RuntimeError(f"the CPU fingerprint kernel is unavailable: {self.failed}")
        words, rowkeys = np.ascontiguousarray(words), np.ascontiguousarray(rowkeys)
        colkeys = np.ascontiguousarray(colkeys)
        rows, width = words.shape
        out = np.empty(rows, dtype=np.uint64)
        threads = max(1, min(threads, words.nbytes // 8 // _MIN_WORDS_PER_THREAD, rows))
        if threads == 1:
            fn(words, width, rowkeys, colkeys, out, 0, rows)
            return out
        self._on_threads(lambda start, stop: fn(words, width, rowkeys, colkeys, out, start, stop), rows, threads)
        return out


    def total(self, data: np.ndarray, rowkeys: np.ndarray, colkeys: np.ndarray, threads: int) -> int:
        """The sum (`scheme.add`) of the row sums of bytes `data` (C-contiguous uint8, any alignment) cut into rows of
        4096, the last zero-padded, keyed by rowkeys (uint64, one per row): one C call per thread, the rows hashed
        where they lie."""
        total = self.fn_total
        if total is None:
            raise RuntimeError(f"the CPU fingerprint kernel is unavailable: {self.failed}")
        return self._split(total, (data,), data.size, rowkeys, colkeys, threads)

    def total_at(self, address: int, nbytes: int, rowkeys: np.ndarray, colkeys: np.ndarray, threads: int) -> int:
        """`total` of the `nbytes` bytes at `address` (a contiguous CPU tensor's data_ptr(): the caller holds the
        tensor until this returns), with no uint8 view or NumPy array made per call."""
        total_at = self.fn_total_at
        if total_at is None:
            raise RuntimeError(f"the CPU fingerprint kernel is unavailable: {self.failed}")
        return self._split(total_at, (address, nbytes), nbytes, rowkeys, colkeys, threads)

    def _split(self, fn: Callable[..., int], data: tuple[object, ...], nbytes: int, rowkeys: np.ndarray,
               colkeys: np.ndarray, threads: int) -> int:
        """fn(*data, rowkeys, colkeys, start, stop) over the rows of `nbytes` bytes, split over up to `threads`
        threads, summed."""
        rows = -(-nbytes // ROW_BYTES)
        if threads > 1:
            threads = min(threads, nbytes // 8 // _MIN_WORDS_PER_THREAD, rows)
        if threads <= 1:
            return fn(*data, rowkeys, colkeys, 0, rows)
        result = 0
        for part in self._on_threads(lambda start, stop: fn(*data, rowkeys, colkeys, start, stop), rows, threads):
            result = add(result, part, self.scheme)
        return result

    def _on_threads(self, call: Callable[[int, int], _T], rows: int, threads: int) -> list[_T]:
        """call(start, stop) for `threads` blocks of `rows` rows, the first on this thread, the others on the pool:
        their results in order. Every call has ended when this returns or raises, so that none still reads the
        caller's memory after the caller lets it go, nor after a block of `bus_errors_caught` ends."""
        bounds = [rows * i // threads for i in range(threads + 1)]
        pool = self._executor(threads)
        futures = [pool.submit(call, bounds[i], bounds[i + 1]) for i in range(1, threads)]
        try:
            first = call(bounds[0], bounds[1])
        finally:
            wait(futures)
        return [first, *(future.result() for future in futures)]


kernel = _Kernel("detrace._fp1", SCHEME)
kernel2 = _Kernel("detrace._fp2", SCHEME2)
