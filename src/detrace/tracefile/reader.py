"""Reading traces back, tolerating the torn tail of a rank that was killed mid-write, refusing corruption.

A rank file that was closed cleanly is a standard Arrow IPC file. A rank killed mid-run has no file footer and
may end in a half-written batch: we read the file as an IPC stream after its 8-byte magic, keep every complete
batch, and report the torn tail (which rank, last complete step) instead of raising.

Every batch is checked against its seal (tracefile.integrity) before anyone sees it. A batch that fails, or a
closed rank whose file no longer matches its footer, raises CorruptTrace naming the file, the batch and its
records: no analysis ever runs on corrupted records, so none can blame an op for a flipped bit.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa

from detrace.errors import NothingRecorded, TraceError
from detrace.tracefile.framing import RECORD_BATCH_MESSAGE, SCHEMA_MESSAGE, Unframed, next_frame
from detrace.tracefile.integrity import arrow_footer_checksum, chain_start, chain_text, verify
from detrace.tracefile.layout import (
    RANK_GLOB,
    rank_of,
    rank_path,
    rank_trace_paths,
    require_regular,
    run_header_path,
)
from detrace.tracefile.metadata import RankFooter, RunHeader, StepAccount, load_json
from detrace.tracefile.schema import ARROW_SCHEMA, SCHEMA_VERSION, format_refusal
from detrace.tracefile.selection import parse_window

_MAGIC = b"ARROW1\x00\x00"


class CorruptTrace(TraceError):
    """A rank file whose bytes no longer match the checksums written with them."""


def load_footer(path: Path) -> RankFooter | None:
    """The validated footer at `path`, or None when the rank never closed its trace."""
    try:
        raw = load_json(path, "rank footer")
    except FileNotFoundError:
        return None
    return RankFooter.from_json(raw, f"rank footer {path}")


def rank_footer(path: Path) -> RankFooter | None:
    """The footer of the rank file at `path`: its footer file's, or, when that file is missing and the rank file
    was closed (it ends in its Arrow file footer, which only a clean close writes), one read from the rank file
    (`RankFooter.rebuilt`); None when the rank never closed its trace."""
    footer = load_footer(path.with_suffix(".json"))
    if footer is not None or arrow_footer_checksum(path) is None:
        return footer
    return rebuilt_footer(path)


def rebuilt_footer(path: Path) -> RankFooter:
    """What a closed rank file's lost footer said, read from its records: every batch verified against its seal."""
    stream = BatchStream(path, footer=None)
    records = batches = 0
    first = last = None
    for batch in stream:
        batches += 1
        records += batch.num_rows
        if batch.num_rows:
            steps = batch.column("step")
            first = steps[0].as_py() if first is None else first
            last = steps[-1].as_py()
    checksum = arrow_footer_checksum(path)
    recorded = None if first is None or last is None else (first, last)
    return RankFooter(schema=SCHEMA_VERSION, rank=rank_of(path), records=records, batches=batches,
                      chain=chain_text(stream._chain), last_step=-1 if last is None else last,
                      arrow_footer=None if checksum is None else chain_text(checksum),
                      steps=None if recorded is None else StepAccount(first=None, recorded=recorded, source=None),
                      rebuilt=True)


class _Unread(enum.Enum):
    UNREAD = enum.auto()


UNREAD: Literal[_Unread.UNREAD] = _Unread.UNREAD
"""A stream's footer not read yet: the stream reads it from beside its rank file."""


class BatchStream:
    """Iterates the complete, verified record batches of one rank file; `torn` and `detail` are set once
    exhausted. Raises CorruptTrace, when it reaches it, for a batch whose seal does not hold.

    `footer` is the rank's footer when the caller has read it already (an opened run: `RankFile.stream`); the
    stream then checks the file against that one, and reads no footer of its own."""

    def __init__(self, path: str | Path, *, footer: RankFooter | _Unread | None = UNREAD) -> None:
        self.path = Path(path)
        self.torn = False
        self.detail: str | None = None
        # A plain file read sequentially (not a memory map): resident memory stays bounded by one batch
        # however long the rank's trace is.
        try:
            require_regular(self.path, "trace file")
            self._file = pa.OSFile(str(self.path), "rb")
        except FileNotFoundError:
            raise TraceError(f"trace file {self.path} does not exist") from None
        except OSError as err:
            raise TraceError(f"cannot read trace file {self.path}: {err}") from None
        if self._file.read(len(_MAGIC)) != _MAGIC:
            self._file.close()
            raise TraceError(f"{self.path} is not a detrace trace file (no Arrow header)")
        try:
            frame = next_frame(self._file.fileno(), len(_MAGIC), self._size())
            if frame is None and self._closed():
                raise Unframed(_LENGTH_CORRUPTED)
            if frame is None:
                raise TraceError(f"{self.path} ends inside its schema (the message at byte {len(_MAGIC)}): it was "
                                 "cut before its first record, or the schema's length is corrupted")
            if frame.end or frame.header_type != SCHEMA_MESSAGE:
                raise Unframed("it holds no schema")
            self._reader = pa.ipc.open_stream(self._file)
        except (Unframed, pa.ArrowException, OSError) as err:
            self._file.close()
            raise CorruptTrace(f"{self.path} is corrupted in its schema (the message at byte {len(_MAGIC)}): "
                               f"{_reason(err)}") from None
        except TraceError:
            self._file.close()
            raise
        try:
            metadata = self._reader.schema.metadata or {}
            version = metadata.get(b"detrace.schema", b"").decode(errors="replace")
            if version != SCHEMA_VERSION:
                raise TraceError(format_refusal(self.path, version or None))
            if not self._reader.schema.remove_metadata().equals(ARROW_SCHEMA):
                raise TraceError(f"{self.path} has columns that differ from schema {SCHEMA_VERSION}")
            text = metadata.get(b"detrace.header", b"")
            try:
                raw = json.loads(text)
            except ValueError:
                raise CorruptTrace(f"{self.path} is corrupted: its header is not JSON") from None
            self.header = RunHeader.from_json(raw, f"the header of {self.path}")
            self.footer = rank_footer(self.path) if footer is UNREAD else footer
        except BaseException:
            self._file.close()
            raise
        self._chain = chain_start(text)

    def close(self) -> None:
        """Release the file (iterating to the end also does)."""
        self._file.close()

    def _size(self) -> int:
        """The file's size now (a rank still running makes it grow)."""
        return os.fstat(self._file.fileno()).st_size

    def _closed(self) -> bool:
        """Whether the file still ends in the Arrow file footer that a clean close writes after every batch. Then a
        message that runs past the file's end was not cut (a cut takes the footer with it): a length in its framing
        is corrupted."""
        return arrow_footer_checksum(self.path) is not None

    def _corrupt(self, index: int, first: int, rows: int | None, reason: str, offset: int) -> CorruptTrace:
        self._file.close()
        records = f"records {first}-{first + rows - 1}" if rows else f"records from {first} on"
        return CorruptTrace(f"{self.path.name} in {self.path.parent} is corrupted in batch {index} ({records}, at "
                            f"byte {offset}): {reason}; detrace does not compare, locate or report a corrupted trace")

    def _next(self, index: int, position: int) -> pa.RecordBatch | None:
        """The next batch, decoded only once its framing is checked, and verified against its seal; None at the
        end of the stream or at a torn tail (then `torn` is set)."""
        offset = self._file.tell()
        try:
            frame = next_frame(self._file.fileno(), offset, self._size())
            if frame is not None and not frame.end and frame.header_type != RECORD_BATCH_MESSAGE:
                raise Unframed("it is not a record batch")
            if frame is None or frame.end:
                if frame is None and self._closed():
                    raise Unframed(_LENGTH_CORRUPTED)
                if frame is None and self.footer is not None:  # a rank that closed cleanly has no torn tail
                    raise Unframed("the file ends inside it (it was cut)")
                self.torn = frame is None
                self.detail = "torn tail: the file ends inside a batch" if frame is None else None
                return None
            batch, metadata = self._reader.read_next_batch_with_custom_metadata()
            batch.validate()  # lengths and offsets in bounds: what the seal's re-serialization reads
        except (Unframed, pa.ArrowException, OSError, StopIteration) as err:
            raise self._corrupt(index, position, None, _reason(err), offset) from None
        try:
            self._chain = verify(batch, metadata, index, self._chain)
        except ValueError as reason:
            raise self._corrupt(index, position, batch.num_rows, str(reason), offset) from None
        return batch

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        index = position = 0
        while True:
            read = self._next(index, position)
            if read is None:
                break
            index += 1
            position += read.num_rows
            yield read
        end = self._file.tell()
        self._file.close()
        footer = self.footer
        if footer is not None and (footer.batches, footer.chain) != (index, chain_text(self._chain)):
            raise self._corrupt(index, position, None, f"its footer seals {footer.batches} batches, the file "
                                "holds these only up to here (batches were cut or replaced)", end)


_LENGTH_CORRUPTED = ("a length in its framing runs past the end of the file, which still ends in the Arrow footer "
                     "of a clean close: the length is corrupted, the file was not cut")


def _reason(err: BaseException) -> str:
    """Why a message could not be read, as a clause."""
    if isinstance(err, Unframed):
        return str(err)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"it cannot be decoded ({first[:200]})"


def iter_batches(path: str | Path) -> BatchStream:
    """Stream the complete batches of a rank file in bounded memory."""
    return BatchStream(path)


@dataclass(frozen=True, kw_only=True)
class RankFile:
    """One rank of an opened run: its trace file and its footer, read once when the run was opened. Small and
    picklable, so the analysis wing hands it to the worker processes that stream the file."""

    rank: int
    """The rank."""
    path: Path
    """Its trace file (`rank-RRRRR.arrow`)."""
    footer: RankFooter | None
    """Its validated footer; None when the rank never closed its trace (it was killed, or still runs)."""

    def stream(self) -> BatchStream:
        """Stream the file's complete batches, checked against this footer (none is read again)."""
        return BatchStream(self.path, footer=self.footer)


@dataclass(frozen=True)
class RankTrace:
    """One rank's records, header and footer."""

    rank: int
    path: Path
    header: RunHeader
    footer: RankFooter | None
    table: pa.Table
    torn: bool
    """The file ends in a partial batch (the process died mid-write)."""
    detail: str | None = None

    @property
    def complete(self) -> bool:
        """The rank closed its trace cleanly (footer present, no torn tail)."""
        return self.footer is not None and not self.torn

    @property
    def last_step(self) -> int:
        """The last step with at least one record (-1 when empty)."""
        if self.table.num_rows == 0:
            return -1
        return int(self.table.column("step")[-1].as_py())

    @property
    def last_complete_step(self) -> int:
        """The last step known to be fully recorded: all of them when complete, else the one before the last."""
        return self.last_step if self.complete else self.last_step - 1


def read_rank(run_dir: str | Path, rank: int) -> RankTrace:
    """Read all complete records of one rank into memory."""
    path = rank_path(run_dir, rank)
    stream = BatchStream(path)
    batches = list(stream)
    table = pa.Table.from_batches(batches, schema=stream._reader.schema)
    return RankTrace(rank=rank, path=path, header=stream.header, footer=stream.footer, table=table,
                     torn=stream.torn, detail=stream.detail)


@dataclass(frozen=True)
class RunInfo:
    """A run directory, opened once (`open_run`): its header, the ranks that wrote a trace and their footers.
    The analysis wing hands this object on from stage to stage instead of re-reading the run by path."""

    path: Path
    header: RunHeader
    """The header of the lowest rank, with the launcher's run.json over it when present."""
    ranks: tuple[int, ...]
    world_size: int
    files: Mapping[int, RankFile] = field(repr=False)
    """Each traced rank's file and footer, by rank (the keys are `ranks`)."""

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        """Ranks below world_size without a trace file (excluding ranks outside the recorded window)."""
        window = self.header.ranks
        wanted = parse_window(window) if window is not None else None
        return tuple(r for r in range(self.world_size)
                     if r not in self.ranks and (wanted is None or r in wanted))


def nothing_recorded(run_dir: Path) -> TraceError:
    """The error for a run directory that holds no rank file: NothingRecorded, saying why, for a run that `detrace
    run` finished (its run.json says so); a plain TraceError for anything else."""
    header_file = run_header_path(run_dir)
    try:
        header = RunHeader.from_json(load_json(header_file, "run header"), f"run header {header_file}")
    except (FileNotFoundError, TraceError):
        header = None
    if header is not None and header.status not in (None, "running") and not header.raw.get("aux"):
        return NothingRecorded(f"nothing was recorded in {run_dir}: {header.why_nothing_recorded()}")
    return TraceError(f"{run_dir} holds no trace (no {RANK_GLOB} files)")


def open_run(path: str | Path) -> RunInfo:
    """Open a run directory, checking that it exists and holds at least one readable rank trace."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise TraceError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise TraceError(f"{run_dir} is not a directory")
    try:
        ranks = rank_trace_paths(run_dir)
    except OSError as err:
        raise TraceError(f"cannot list run directory {run_dir}: {err.strerror}") from None
    if not ranks:
        raise nothing_recorded(run_dir)
    lowest = BatchStream(ranks[min(ranks)])  # its header, then its footer
    lowest.close()
    merged = dict(lowest.header.raw)
    header_file = run_header_path(run_dir)
    with contextlib.suppress(FileNotFoundError):
        merged.update(RunHeader.from_json(load_json(header_file, "run header"), f"run header {header_file}").raw)
    header = RunHeader.from_json(merged, f"the header of {run_dir}")
    world_size = header.world_size or max(ranks) + 1
    if world_size <= max(ranks):
        raise TraceError(f"{run_dir} is inconsistent: its header says world size {world_size}, but rank "
                         f"{max(ranks)} wrote a trace")
    # Every footer is read here, once; whoever the run is handed to asks it, never the file.
    files = {rank: RankFile(rank=rank, path=path,
                            footer=lowest.footer if rank == min(ranks) else rank_footer(path))
             for rank, path in ranks.items()}
    return RunInfo(path=run_dir, header=header, ranks=tuple(ranks), world_size=world_size, files=files)
