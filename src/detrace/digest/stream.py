"""The fingerprint of a tensor whose bytes arrive piece by piece (a checkpoint's records, read from a file).

The digest is a sum over zero-padded 4096-byte rows, each keyed by its row number (detrace.digest.scheme), so
pieces of whole rows can be hashed in any order, by any thread, and their partial sums added: the result is the
digest that `detrace.fingerprint` gives for the whole tensor. Verify reads a record whose tensor bytes are not
8-byte aligned in its file (most of them: DCP packs records end to end) into small reused buffers this way,
instead of copying the whole tensor into fresh memory first.
"""

from __future__ import annotations

import math
import threading

import torch

from detrace.digest.inputs import dtype_name
from detrace.digest.kernels import device_tables, kernel, selected_backend
from detrace.digest.scheme import ROW_BYTES, Fingerprint, add, header

PIECE_ALIGN = ROW_BYTES
"""Every piece but the last starts and ends on a row boundary."""


class StreamedFingerprint:
    """The fingerprint of a CPU tensor of `dtype` and `shape` in `scheme`, fed its logical bytes in pieces (make it
    in one thread; `add` from any)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], scheme: str) -> None:
        self.dtype, self.shape, self.scheme = dtype, shape, scheme
        self.nbytes = math.prod(shape) * dtype.itemsize
        backend = selected_backend()
        self._backend = "eager" if backend == "reference" else backend
        self._total = 0
        self._lock = threading.Lock()
        # The row keys, taken now: `add` runs in threads, and the shared table may be replaced while it grows.
        self._keys = device_tables(torch.device("cpu")).rowkeys(-(-self.nbytes // ROW_BYTES), scheme)

    def add(self, data: torch.Tensor, at: int) -> None:
        """Add bytes [at, at + len(data)) of the tensor: `data` a 1-D uint8 CPU tensor, 8-byte aligned, `at` a
        multiple of 4096, and its end a multiple of 4096 unless it is the tensor's end. Thread-safe."""
        count = data.numel()
        if at % ROW_BYTES or at + count > self.nbytes or (count % ROW_BYTES and at + count != self.nbytes):
            raise ValueError(f"a piece at {at} of {count} bytes does not fit a tensor of {self.nbytes} bytes")
        if count == 0:
            return
        rows = -(-count // ROW_BYTES)
        first = at // ROW_BYTES
        if count % ROW_BYTES:  # the last row, zero-padded as the definition pads it
            padded = torch.zeros(rows * ROW_BYTES, dtype=torch.uint8)
            padded[:count] = data
            data = padded
        words = data.view(torch.int64).view(rows, ROW_BYTES // 8)
        keys = self._keys[first : first + rows]
        partial = int(kernel("total", words, keys, self._backend, self.scheme).numpy().view("uint64")[0])
        with self._lock:
            self._total = add(self._total, partial, self.scheme)

    def result(self) -> Fingerprint:
        """The fingerprint, once every byte was added."""
        name = dtype_name(self.dtype)
        digest = add(header(name, self.shape, self.scheme), self._total, self.scheme)
        return Fingerprint(digest, name, self.shape, math.prod(self.shape), scheme=self.scheme)
