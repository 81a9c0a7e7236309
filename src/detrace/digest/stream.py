"""The fingerprint of a tensor whose bytes arrive piece by piece (a checkpoint's records, read from a file).

The digest is a sum over zero-padded 4096-byte rows, each keyed by its row number (detrace.digest.scheme), so
pieces of whole rows can be hashed in any order, by any thread, and their partial sums added: the result is the
digest that `detrace.fingerprint` gives for the whole tensor. Verify hashes a checkpoint's records this way, a
piece per thread: straight from the mapped file where the native kernel runs (it reads words at any alignment, and
each call hashes its piece on its own thread: the threads are the pieces'), else read into small aligned buffers.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from detrace.digest.inputs import dtype_name
from detrace.digest.kernels import device_tables, kernel, native_total, runs_native, selected_backend
from detrace.digest.scheme import ROW_BYTES, Fingerprint, add, header

PIECE_ALIGN = ROW_BYTES
"""Every piece but the last starts and ends on a row boundary."""


def _backend() -> str:
    backend = selected_backend()
    return "eager" if backend == "reference" else backend


def hashes_in_place(scheme: str) -> bool:
    """Whether pieces in `scheme` are hashed by the native kernel, which reads them at any address (else each piece
    must be 8-byte aligned)."""
    return runs_native(_backend(), scheme)


class StreamedFingerprint:
    """The fingerprint of a CPU tensor of `dtype` and `shape` in `scheme`, fed its logical bytes in pieces (make it
    in one thread; `add` from any)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], scheme: str) -> None:
        self.dtype, self.shape, self.scheme = dtype, shape, scheme
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._backend = _backend()
        self._native = runs_native(self._backend, scheme)
        self._total = 0
        self._lock = threading.Lock()
        # The row keys, taken now: `add` runs in threads, and the shared table may be replaced while it grows.
        self._keys = device_tables(torch.device("cpu")).rowkeys(-(-self.nbytes // ROW_BYTES), scheme)

    def add(self, data: np.ndarray, at: int) -> None:
        """Add bytes [at, at + len(data)) of the tensor: `data` 1-D uint8, 8-byte aligned unless
        `hashes_in_place(scheme)`, `at` a multiple of 4096, and its end a multiple of 4096 unless it is the tensor's
        end. Thread-safe."""
        count = data.size
        if at % ROW_BYTES or at + count > self.nbytes or (count % ROW_BYTES and at + count != self.nbytes):
            raise ValueError(f"a piece at {at} of {count} bytes does not fit a tensor of {self.nbytes} bytes")
        if count == 0:
            return
        rows = -(-count // ROW_BYTES)
        first = at // ROW_BYTES
        keys = self._keys[first : first + rows]
        if self._native:  # on this thread only: the caller's threads share the pieces
            partial = native_total(data, keys.numpy().view(np.uint64), self.scheme, threads=1)
        else:
            if count % ROW_BYTES:  # the last row, zero-padded as the definition pads it
                padded = np.zeros(rows * ROW_BYTES, dtype=np.uint8)
                padded[:count] = data
                data = padded
            words = torch.from_numpy(data).view(torch.int64).view(rows, ROW_BYTES // 8)
            partial = int(kernel("total", words, keys, self._backend, self.scheme).numpy().view("uint64")[0])
        with self._lock:
            self._total = add(self._total, partial, self.scheme)

    def result(self) -> Fingerprint:
        """The fingerprint, once every byte was added."""
        name = dtype_name(self.dtype)
        digest = add(header(name, self.shape, self.scheme), self._total, self.scheme)
        return Fingerprint(digest, name, self.shape, math.prod(self.shape), scheme=self.scheme)
