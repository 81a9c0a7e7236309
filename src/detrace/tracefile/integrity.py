"""Integrity of a rank file: a checksum per record batch and a running chain over all of them.

Each batch carries, in its own IPC metadata, its index in the file, the CRC-32 of its serialized bytes, and the
chain: the CRC-32 of the rank header followed by every batch up to and including this one. A flipped bit in any
column changes the batch's checksum; a lost, repeated or reordered batch, or an altered header, breaks the chain.
A torn tail cannot fake either: the seal is written in the same message as the batch it seals, so a batch is
either read whole with its seal or not read at all. The footer, written atomically last, holds the final chain
and the batch count, so a file cut cleanly at a batch boundary is caught too.

Checksums cover `RecordBatch.serialize()`: the writer seals the bytes the IPC writer puts on disk, the reader
re-serializes the batch it decoded, which gives the same bytes whenever nothing changed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import pyarrow as pa

BATCH_KEY = b"detrace.batch"
CRC_KEY = b"detrace.crc"
CHAIN_KEY = b"detrace.chain"


def chain_start(header: bytes) -> int:
    """The chain before the first batch: the checksum of the rank header as stored in the schema metadata."""
    return zlib.crc32(header)


def seal(batch: pa.RecordBatch, index: int, chain: int) -> tuple[dict[bytes, bytes], int]:
    """The metadata that seals batch `index` after `chain`, and the chain that follows it."""
    body = batch.serialize()
    crc = zlib.crc32(body)
    chain = zlib.crc32(body, chain)
    return {BATCH_KEY: str(index).encode(), CRC_KEY: f"{crc:08x}".encode(), CHAIN_KEY: f"{chain:08x}".encode()}, chain


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
    return f"{chain:08x}"
