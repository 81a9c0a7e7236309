"""One rank file read for the alignment: batch by batch, with a bounded look-ahead window, never whole.

`compare.align` advances two cursors, one per run, over the same rank's records; a cursor holds the batches it
has read but not yet consumed, so memory stays a few batches per side however long the run. Records compared apart
(checkpoint I/O, framework bookkeeping: detrace.analyze.apart) are set aside as the batches are read.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pyarrow as pa

from detrace.analyze.apart import split
from detrace.tracefile import RankFile


class RankCursor:
    """One side of the alignment: a buffered, advancing view over a rank file's batches."""

    def __init__(self, file: RankFile | None, *, end: int | None = None) -> None:
        """`file`: the rank in its opened run (its footer read there, not again here); None when the run has no
        trace of this rank."""
        self.stream = file.stream() if file is not None else None
        self.footer = file.footer if file is not None else None
        self._batches = iter(self.stream) if self.stream is not None else iter(())
        self._buffer: deque[pa.RecordBatch] = deque()
        self._buffered = 0
        self.position = 0
        """Records consumed so far."""
        self.end = end
        """The last global step compared: records of later steps are left out (None: to the end of the file)."""
        self.apart: list[pa.RecordBatch] = []
        """The records set aside, read so far, to be compared apart (detrace.analyze.apart)."""

    @property
    def complete(self) -> bool:
        """The rank closed its trace cleanly (meaningful once exhausted)."""
        return self.stream is not None and self.footer is not None and not self.stream.torn

    def _fill(self) -> bool:
        for batch in self._batches:
            if self.end is not None and batch.num_rows and batch.column("step")[-1].as_py() > self.end:
                # Steps never decrease within a rank: the rest of the file lies past the compared steps.
                batch = batch.slice(0, int(np.searchsorted(batch.column("step").to_numpy(), self.end, side="right")))
                self._batches = iter(())
            batch, apart = split(batch)
            if apart is not None:
                self.apart.append(apart)
            if batch.num_rows:
                self._buffer.append(batch)
                self._buffered += batch.num_rows
                return True
        return False

    def head(self) -> pa.RecordBatch | None:
        """The unconsumed rest of the first buffered batch; None once the file is exhausted."""
        if not self._buffer and not self._fill():
            return None
        return self._buffer[0]

    def window(self, n: int) -> pa.Table:
        """The next `n` records (fewer at the end of the file), without consuming them."""
        while self._buffered < n and self._fill():
            pass
        return pa.Table.from_batches(list(self._buffer)).slice(0, n)

    def advance(self, n: int) -> None:
        self.position += n
        self._buffered -= n
        while n:
            batch = self._buffer[0]
            if n >= batch.num_rows:
                self._buffer.popleft()
                n -= batch.num_rows
            else:
                self._buffer[0] = batch.slice(n)
                n = 0

    def skip_to_step(self, step: int) -> None:
        """Consume every record of a step below `step` (steps never decrease within a rank)."""
        while (head := self.head()) is not None:
            below = int(np.searchsorted(head.column("step").to_numpy(), step))
            self.advance(below)
            if below < head.num_rows:
                return

    def drain(self) -> int:
        """Consume the rest of the file; return how many records it held."""
        left = 0
        while (head := self.head()) is not None:
            left += head.num_rows
            self.advance(head.num_rows)
        return left
