"""The framing of the next Arrow IPC message in a rank file, checked before pyarrow reads it.

pyarrow trusts the lengths a message states: a flipped bit in a message's body length makes it allocate that
many bytes (`malloc of size 576460752303423808`), and other damage to a message's metadata reaches asserts that
abort the process. So the reader checks, on the bytes themselves, that the next message is framed as the writer
frames a record batch (the continuation marker, a metadata length that fits, a body length that fits what the file
still holds) before pyarrow allocates anything. What lies inside the metadata is checked by pyarrow's own
validation of the decoded batch, then by the batch's seal (tracefile.integrity).

A message is an IPC "encapsulated message": 0xFFFFFFFF, the flatbuffer's length (int32), the flatbuffer `Message`
(padded to 8 bytes), then the body. The `Message` table's fields are version (0), header type (1), header (2),
body length (3), custom metadata (4) (Arrow's format/Message.fbs).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

CONTINUATION = 0xFFFFFFFF
_PREFIX = 8
"""The continuation marker and the metadata length."""
_BODY_LENGTH_FIELD = 3
_HEADER_TYPE_FIELD = 1
SCHEMA_MESSAGE = 1
RECORD_BATCH_MESSAGE = 3


class Unframed(ValueError):
    """The next message is not framed as a message: the reason is the text."""


@dataclass(frozen=True, kw_only=True)
class Frame:
    """The next message of a stream, framed within the file: what it holds."""

    end: bool
    """It is the end-of-stream marker (no message follows)."""
    header_type: int = 0
    """The flatbuffer `MessageHeader` type (1 schema, 3 record batch)."""


def _field(metadata: bytes, table: int, vtable: int, vtable_size: int, index: int, fmt: str) -> int:
    """Field `index` of the flatbuffer table (0 when absent), every offset checked against the buffer."""
    slot = 4 + 2 * index
    if slot + 2 > vtable_size:
        return 0
    (offset,) = struct.unpack_from("<H", metadata, vtable + slot)
    if offset == 0:
        return 0
    at = table + offset
    if at + struct.calcsize(fmt) > len(metadata):
        raise Unframed("a field of its metadata points past the metadata's end")
    value: int = struct.unpack_from(fmt, metadata, at)[0]
    return value


def next_frame(fd: int, offset: int, size: int) -> Frame | None:
    """The frame of the message at `offset` of the open file `fd` (`size` bytes long), or None where the file ends
    before the message does (a torn tail, or a cut). Raises Unframed when the bytes are not a message's framing.
    Reads with pread: the file's position, which pyarrow reads from, stays where it is."""
    prefix = os.pread(fd, _PREFIX, offset) if offset + _PREFIX <= size else b""
    if len(prefix) < _PREFIX:
        return None
    marker, length = struct.unpack("<Ii", prefix)
    if marker != CONTINUATION:
        raise Unframed("it does not begin with the continuation marker of an IPC message")
    if length == 0:
        return Frame(end=True)
    if length < 0 or length % 8:
        raise Unframed(f"its metadata length {length} is not a positive multiple of 8")
    if offset + _PREFIX + length > size:
        return None
    metadata = os.pread(fd, length, offset + _PREFIX)
    if len(metadata) < length:
        return None
    (table,) = struct.unpack_from("<I", metadata, 0)
    if table + 4 > length:
        raise Unframed("its metadata's root table lies past its end")
    (back,) = struct.unpack_from("<i", metadata, table)
    vtable = table - back
    if not 0 <= vtable <= length - 4:
        raise Unframed("its metadata's table layout lies outside the metadata")
    vtable_size, _ = struct.unpack_from("<HH", metadata, vtable)
    if vtable_size < 4 or vtable + vtable_size > length:
        raise Unframed("its metadata's table layout lies outside the metadata")
    header_type = _field(metadata, table, vtable, vtable_size, _HEADER_TYPE_FIELD, "<B")
    body = _field(metadata, table, vtable, vtable_size, _BODY_LENGTH_FIELD, "<q")
    if header_type not in (SCHEMA_MESSAGE, RECORD_BATCH_MESSAGE):
        raise Unframed(f"it is a message of type {header_type}, neither a schema nor a record batch")
    if body < 0 or body % 8:
        raise Unframed(f"its body length {body} is not a non-negative multiple of 8")
    if offset + _PREFIX + length + body > size:
        return None
    return Frame(end=False, header_type=header_type)
