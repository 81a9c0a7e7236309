"""Integrity of a rank file: a checksum per record batch and a running chain over all of them.

Each batch carries, in its own IPC metadata, its index in the file, the checksum of its serialized bytes, and
the chain: a running, order-sensitive combination of the rank header's checksum and every batch's up to and
including this one. The checksum is a position-keyed sum mod 2**64 of the bytes read as 64-bit words (each
word times its own odd key): a flipped bit anywhere changes it always (an odd key times a power of two is
never 0 mod 2**64), other damage except with probability about 2**-64; in NumPy it runs at memory speed,
several times faster than zlib's CRC-32, which cost `detrace diff` a third of its speed. A lost, repeated
or reordered batch, or an altered header, breaks the chain. A torn tail cannot fake either: the seal is
written in the same message as the batch it seals, so a batch is either read whole with its seal or not read
at all. The footer, written atomically last, holds the final chain and the batch count, so a file cut
cleanly at a batch boundary is caught too.

Arrow's file readers (pyarrow.ipc.open_file, pandas, Polars, DuckDB) read more than the stream: the file footer,
which holds a copy of the schema with the rank header and the offsets of every batch. Its checksum
(`arrow_footer_checksum`), taken when the file is closed, is kept in the rank footer, so `detrace certify` catches
a flip there too, though detrace's own reader never reads it.

Checksums cover `RecordBatch.serialize()`: the writer seals the bytes the IPC writer puts on disk, the reader
re-serializes the batch it decoded, which gives the same bytes whenever nothing changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa

BATCH_KEY = b"detrace.batch"
CRC_KEY = b"detrace.checksum"
CHAIN_KEY = b"detrace.chain"


_M64 = (1 << 64) - 1
_CHAIN = 0x9E3779B97F4A7C15  # odd: chain' = chain * _CHAIN + checksum is a bijection of chain, order-sensitive
_keys = np.zeros(0, dtype=np.uint64)


def _word_keys(n: int) -> np.ndarray:
    """Odd keys for word positions 0..n-1 (grown on demand, shared)."""
    global _keys
    if n > _keys.size:
        size = max(n, 2 * _keys.size, 1 << 16)
        position = np.arange(size, dtype=np.uint64)
        mixed = (position ^ (position >> np.uint64(7))) * np.uint64(0xBF58476D1CE4E5B9)
        _keys = mixed | np.uint64(1)
    return _keys[:n]


def checksum(data: bytes | pa.Buffer) -> int:
    """The position-keyed sum mod 2**64 of `data` as little-endian 64-bit words (the tail zero-padded)."""
    view = memoryview(data).cast("B")
    n = len(view) // 8
    words = np.frombuffer(view, dtype="<u8", count=n)
    total = int((words * _word_keys(n)).sum(dtype=np.uint64)) if n else 0
    tail = bytes(view[8 * n :])
    if tail:
        total += int.from_bytes(tail.ljust(8, b"\0"), "little") * int(_word_keys(n + 1)[n])
    return (total + len(view)) & _M64


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex: for files a reader must trust whole (checkpoint files, code a trace
    names), where a cryptographic hash, not a checksum against accidents, is the point."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


_ARROW_END = b"ARROW1"
_ARROW_TRAILER = 4 + len(_ARROW_END)  # the footer's length (int32, little-endian), then the magic


def arrow_footer_checksum(path: Path) -> int | None:
    """The checksum of a closed Arrow IPC file's footer, its length and the closing magic; None when the file
    does not end in a footer (no closing magic, or a length that does not fit the file)."""
    with path.open("rb") as stream:
        size = stream.seek(0, 2)
        if size < 2 * _ARROW_TRAILER:
            return None
        stream.seek(size - _ARROW_TRAILER)
        trailer = stream.read(_ARROW_TRAILER)
        length = int.from_bytes(trailer[:4], "little", signed=True)
        if trailer[4:] != _ARROW_END or not 0 < length <= size - 2 * _ARROW_TRAILER:
            return None
        stream.seek(size - _ARROW_TRAILER - length)
        return checksum(stream.read(length + _ARROW_TRAILER))


def _after(chain: int, value: int) -> int:
    return (chain * _CHAIN + value) & _M64


def chain_start(header: bytes) -> int:
    """The chain before the first batch: the checksum of the rank header as stored in the schema metadata."""
    return checksum(header)


def seal(batch: pa.RecordBatch, index: int, chain: int) -> tuple[dict[bytes, bytes], int]:
    """The metadata that seals batch `index` after `chain`, and the chain that follows it."""
    value = checksum(batch.serialize())
    chain = _after(chain, value)
    return {BATCH_KEY: str(index).encode(), CRC_KEY: f"{value:016x}".encode(),
            CHAIN_KEY: f"{chain:016x}".encode()}, chain


def verify(batch: pa.RecordBatch, metadata: Mapping[bytes, bytes] | None, index: int, chain: int) -> int:
    """The chain after batch `index`; raises ValueError with the reason (a clause) when its seal does not hold."""
    metadata = metadata or {}
    if not all(key in metadata for key in (BATCH_KEY, CRC_KEY, CHAIN_KEY)):
        raise ValueError("it carries no checksum")
    if metadata[BATCH_KEY] != str(index).encode():
        raise ValueError(f"it is sealed as batch {metadata[BATCH_KEY].decode(errors='replace')}, so batches "
                         "were lost or reordered before it")
    expected, after = seal(batch, index, chain)
    if metadata[CRC_KEY] != expected[CRC_KEY]:
        raise ValueError("its bytes do not match its checksum")
    if metadata[CHAIN_KEY] != expected[CHAIN_KEY]:
        raise ValueError("it does not follow the batches and header before it (the chain is broken)")
    return after


def chain_text(chain: int) -> str:
    """The chain as the footer stores it."""
    return f"{chain:016x}"
