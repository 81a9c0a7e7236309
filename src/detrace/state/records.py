"""The tensor records of DCP's files read in place, without pickle.

DCP stores every tensor chunk as one `torch.save` record: a zip archive, stored uncompressed, whose entry
`<archive>/data/0` holds the tensor's bytes and whose other entries (the small `data.pkl` naming dtype, shape and
strides, the byte order, the zip headers) describe them. torch's own reader unpickles `data.pkl` (restricted), copies
the bytes out of the archive and checks their CRC-32: most of the time of a verify on warm files went there.

Here the save locates each record's tensor bytes once (`frame_of`, with `zipfile` reading the zip directory: no
pickle) and the manifest keeps, per chunk, where they start in the record (`data_at`) and the SHA-256 of the
record's other bytes (`frame`). The planner stores every chunk C-contiguous, so the tensor bytes are the chunk's
elements in order. Verify then reads the records directly (`read_batches`): the frame against its SHA-256 (a change
to `data.pkl`, the strides or the byte order is damage like any other) and the tensor bytes: where the native
kernel runs, hashed where they lie in the mapped file (`mmap`, no copy, any alignment) 4 MiB at a time by threads;
else mapped in place where they sit on an 8-byte boundary of
the file (the other kernels read 8-byte words), and read 4 MiB at a time into a few reused buffers and hashed piece
by piece (detrace.digest.stream) by threads where not, while the caller hashes the mapped tensors of the batch
before. DCP packs records end to end, so most tensor bytes are unaligned; fresh memory is not cheap either (a first
touch costs a page fault per 4 KiB), so no tensor is ever copied whole. A file truncated by another process while
it is read through the map raises SIGBUS in the native kernel, which it turns into an error while verify reads
(`bus_errors_caught`): one sentence, not the end of the process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import mmap
import os
import stat
import struct
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import BinaryIO

import numpy as np
import torch

from detrace.digest.kernels import native_kernel
from detrace.digest.scheme import Fingerprint
from detrace.digest.stream import PIECE_ALIGN, StreamedFingerprint, hashes_in_place
from detrace.errors import CheckpointCorrupted, CheckpointError

_DATA = "/data/0"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_ALIGN = 8  # the fingerprint kernels read 8-byte words: tensor bytes at another file offset are read into a buffer
_PIECE = 1024 * PIECE_ALIGN  # bytes read and hashed at once by one thread (4 MiB): few enough to stay in cache


@dataclass(frozen=True, kw_only=True)
class Frame:
    """Where a record's tensor bytes lie, and the checksum of everything else in the record."""

    data_at: int
    """Byte offset of the tensor bytes within the record."""
    data_bytes: int
    """Their length."""
    sha256: str
    """SHA-256 (hex) of the record's other bytes: the bytes before the tensor's, then those after."""


@dataclass(frozen=True, kw_only=True)
class Wanted:
    """A record that verify reads in place: where it is and what the manifest says of it."""

    fqn: str
    """The tensor's name (for messages)."""
    label: str
    """How a message names the chunk (`'model.0.weight'`, with its offsets when it is a shard)."""
    file: str
    """File of the checkpoint directory holding the record."""
    start: int
    """Byte offset of the record in the file."""
    length: int
    """Byte length of the record."""
    frame: Frame
    """The manifest's frame of the record."""
    dtype: torch.dtype
    """The chunk's dtype, from the manifest."""
    shape: tuple[int, ...]
    """The chunk's shape, from the manifest."""


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (a record, for `zipfile`)."""

    def __init__(self, stream: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._stream, self._start, self._length, self._pos = stream, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = max(0, min(len(buffer), self._length - self._pos))
        self._stream.seek(self._start + self._pos)
        got = self._stream.readinto(memoryview(buffer)[:count])  # type: ignore[attr-defined]
        self._pos += got
        return got


def frame_of(stream: BinaryIO, start: int, length: int) -> Frame | None:
    """The frame of the torch.save record at [start, start + length) of the open file `stream`, or None when it is
    not one plain tensor stored uncompressed (verify then reads it with torch's reader)."""
    try:
        with zipfile.ZipFile(_Window(stream, start, length)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    data = [entry for entry in entries if "/data/" in entry.filename]
    if len(data) != 1 or not data[0].filename.endswith(_DATA) or data[0].compress_type != zipfile.ZIP_STORED:
        return None
    stream.seek(start + data[0].header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name, extra = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    data_at = data[0].header_offset + _LOCAL_HEADER.size + name + extra
    data_bytes = data[0].file_size
    if data_at + data_bytes > length:
        return None
    return Frame(data_at=data_at, data_bytes=data_bytes,
                 sha256=_frame_sha256(stream.fileno(), start, length, data_at, data_bytes))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path: Path) -> int:
    """A read-only descriptor of the checkpoint file `path`. It must be a regular file (a link to one included):
    opening a FIFO for reading waits for a writer for ever, and a device reads without end. The file is opened
    without blocking and checked on the descriptor, not on the name (which could be replaced in between), then made
    blocking. Missing or not a regular file is damage (CheckpointCorrupted: the checkpoint is not what was saved);
    another error of the system (permissions, I/O) is a CheckpointError (no answer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointCorrupted(f"{path} is missing") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        raise CheckpointCorrupted(f"{path} is not a regular file ({kind})")
    os.set_blocking(fd, True)
    return fd


def _frame_sha256(fd: int, start: int, length: int, data_at: int, data_bytes: int) -> str:
    head = os.pread(fd, data_at, start)
    tail = os.pread(fd, length - data_at - data_bytes, start + data_at + data_bytes)
    return hashlib.sha256(head + tail).hexdigest()


class _File:
    """One open file of the checkpoint, mapped once for the records whose tensor bytes are read in place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_regular(path)
        self.size = os.fstat(self.fd).st_size
        self._map: mmap.mmap | None = None
        self._bytes: np.ndarray | None = None

    def mapped(self) -> mmap.mmap:
        """The file mapped (made by the caller's thread, `_start`, before any piece of it is hashed)."""
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        return self._map

    def bytes(self) -> np.ndarray:
        """The mapped file as uint8, for the pool's threads: `mapped` was called first."""
        assert self._bytes is not None
        return self._bytes

    def close(self) -> None:
        os.close(self.fd)  # the map, if any, stays valid while tensors use it and goes with the last of them


def read_batches(directory: Path, wanted: Sequence[Wanted], *, batch_bytes: int, workers: int, scheme: str
                 ) -> Iterator[list[tuple[Wanted, torch.Tensor | Fingerprint | CheckpointCorrupted]]]:
    """What each record holds, in batches of about `batch_bytes`, in the order of `wanted`: its tensor mapped in
    place (dtype and shape from the manifest) for the caller to fingerprint, or the fingerprint in `scheme` of
    tensor bytes that are not aligned in the file (read into small reused buffers and hashed piece by piece by
    `workers` threads, while the caller hashes the batch before), or the damage found. A batch's tensors are
    valid until the caller asks for the next batch."""
    files: dict[str, _File] = {}
    try:
        for item in wanted:
            if item.file not in files:
                if Path(item.file).name != item.file:
                    raise CheckpointError(f"a record of tensor {item.fqn!r} points outside the checkpoint "
                                          f"({item.file!r})")
                files[item.file] = _File(directory / item.file)
        batches: list[list[Wanted]] = [[]]
        size = 0
        for item in wanted:
            if size >= batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(item)
            size += item.frame.data_bytes
        workers = max(1, workers)
        buffers: SimpleQueue[np.ndarray] | None = None
        # every record read through the map: a file truncated meanwhile is one sentence, while the pool reads
        caught = native_kernel(scheme).bus_errors_caught() if hashes_in_place(scheme) else contextlib.nullcontext()
        if not hashes_in_place(scheme):
            buffers = SimpleQueue()
            for _ in range(workers):
                buffers.put(np.empty(_PIECE, dtype=np.uint8))
        with caught, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="detrace-verify") as pool:
            pending = _start(pool, files, batches[0], buffers, scheme)
            for index in range(len(batches)):
                started, futures = pending
                if index + 1 < len(batches):  # queued behind this batch's pieces: the pool never waits for the caller
                    pending = _start(pool, files, batches[index + 1], buffers, scheme)
                for future in futures:
                    future.result()
                yield [(item, _result(files[item.file], item, found)) for item, found in started]
    finally:
        for file in files.values():
            file.close()


def _start(pool: ThreadPoolExecutor, files: dict[str, _File], batch: list[Wanted],
           buffers: SimpleQueue[np.ndarray] | None, scheme: str
           ) -> tuple[list[tuple[Wanted, StreamedFingerprint | CheckpointCorrupted | None]], list[Future[None]]]:
    """Check the frames of a batch, ask the kernel to read ahead what is mapped, and start hashing pieces in the
    pool: every record's, from the map, where the native kernel runs (`buffers` None); else those not aligned,
    read into `buffers`, while the caller hashes the aligned ones, mapped."""
    started: list[tuple[Wanted, StreamedFingerprint | CheckpointCorrupted | None]] = []
    futures: list[Future[None]] = []
    for item in batch:
        file = files[item.file]
        damage = _check(file, item)
        at = item.start + item.frame.data_at
        if damage is not None or item.frame.data_bytes == 0:
            started.append((item, damage))
            continue
        aligned = at % max(_ALIGN, item.dtype.itemsize) == 0
        if buffers is None or aligned:  # mapped: read ahead while the batch before is hashed
            first = at - at % mmap.PAGESIZE
            file.mapped().madvise(mmap.MADV_WILLNEED, first, at + item.frame.data_bytes - first)
        if buffers is not None and aligned:  # the caller hashes it, mapped
            started.append((item, None))
        else:
            streamed = StreamedFingerprint(item.dtype, item.shape, scheme)
            started.append((item, streamed))
            futures += [pool.submit(_hash_piece, file, at, piece, min(_PIECE, item.frame.data_bytes - piece),
                                    streamed, buffers)
                        for piece in range(0, item.frame.data_bytes, _PIECE)]
    return started, futures


def _hash_piece(file: _File, at: int, piece: int, count: int, streamed: StreamedFingerprint,
                buffers: SimpleQueue[np.ndarray] | None) -> None:
    if buffers is None:  # the native kernel reads the mapped file in place, at any alignment
        try:
            streamed.add(file.bytes()[at + piece : at + piece + count], piece)
        except OSError as err:  # the kernel's read raised SIGBUS: the file shrank under the map since it was checked
            if err.errno != errno.EFAULT:
                raise
            raise CheckpointError(f"{file.path} changed while it was being verified") from None
        return
    buffer = buffers.get()
    try:
        _pread(file, buffer.data[:count], at + piece)
        streamed.add(buffer[:count], piece)
    finally:
        buffers.put(buffer)


def _pread(file: _File, into: memoryview, at: int) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(file.fd, [into[done:]], at + done)
        if got == 0:  # the file shrank since it was checked: reported as damage when the frame is read again
            raise CheckpointError(f"{file.path} changed while it was being verified")
        done += got


def _check(file: _File, item: Wanted) -> CheckpointCorrupted | None:
    """The damage of a record that its frame reveals, if any: a file too short, a frame whose bytes changed, a
    manifest's dtype and shape that do not fill the tensor bytes."""
    if min(item.start, item.length) < 0:
        return CheckpointCorrupted(f"{file.path}: the record of tensor {item.fqn!r} has a negative place or size")
    if item.start + item.length > file.size:
        missing = item.start + item.length - file.size
        return CheckpointCorrupted(f"{file.path} is truncated: tensor {item.fqn!r} is missing {missing} bytes")
    frame = item.frame
    numel = 1
    for size in item.shape:
        numel *= size
    fits = frame.data_at + frame.data_bytes <= item.length and numel * item.dtype.itemsize == frame.data_bytes
    if not fits or _frame_sha256(file.fd, item.start, item.length, frame.data_at, frame.data_bytes) != frame.sha256:
        return CheckpointCorrupted(f"tensor {item.label}'s stored record (what describes its bytes) does not "
                                   f"match the manifest")
    return None


def _result(file: _File, item: Wanted, found: StreamedFingerprint | CheckpointCorrupted | None
            ) -> torch.Tensor | Fingerprint | CheckpointCorrupted:
    if isinstance(found, CheckpointCorrupted):
        return found
    if isinstance(found, StreamedFingerprint):
        return found.result()
    if item.frame.data_bytes == 0:
        return torch.empty(item.shape, dtype=item.dtype)
    with warnings.catch_warnings():  # read-only on purpose: the tensor is only hashed
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(file.mapped(), dtype=torch.uint8, count=item.frame.data_bytes,
                                offset=item.start + item.frame.data_at)
    return data.view(item.dtype).view(item.shape)
