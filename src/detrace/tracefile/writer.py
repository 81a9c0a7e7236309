"""Append-only writer of one rank's trace.

Records are buffered and written as Arrow record batches, flushed in bounded batches (by count and by time)
and whenever the tracer asks (end of step). The file is an Arrow IPC *file*: after a clean close any Arrow
reader (pyarrow, Polars, DuckDB via pyarrow, pandas.read_feather) opens it; after a crash every complete batch
is still recoverable by `detrace.tracefile.reader`, which reads it as a stream and reports the torn tail.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from detrace.errors import TraceError
from detrace.tracefile.columns import column
from detrace.tracefile.integrity import arrow_footer_checksum, chain_start, chain_text, seal
from detrace.tracefile.layout import aux_footer_path, aux_path, footer_path, rank_path
from detrace.tracefile.schema import ARROW_SCHEMA, COLUMN_NAMES, SCHEMA_VERSION


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> None:
    """Write JSON to a temporary file beside `path`, fsync it, and rename it into place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RankWriter:
    """Writes the records of one rank to `<run_dir>/rank-RRRRR.arrow` (with `aux_pid`: the records of a process
    that is not a rank to `<run_dir>/aux-PID.arrow`; `rank` is then None)."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int | None,
        *,
        header: dict[str, Any],
        batch_records: int = 4096,
        flush_seconds: float = 1.0,
        force: bool = False,
        aux_pid: int | None = None,
    ) -> None:
        if (rank is None) == (aux_pid is None):
            raise TraceError("a trace file belongs to a rank or to an auxiliary process, not both or neither")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.batch_records = batch_records
        self.flush_seconds = flush_seconds
        if rank is not None:
            self.path, self._footer = rank_path(self.run_dir, rank), footer_path(self.run_dir, rank)
        else:
            assert aux_pid is not None
            self.path, self._footer = aux_path(self.run_dir, aux_pid), aux_footer_path(self.run_dir, aux_pid)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TraceError(f"cannot create trace directory {self.run_dir}: {err.strerror}") from None
        if self.path.exists() and not force:
            raise TraceError(f"{self.path} already holds a trace; choose another directory or pass --force")
        self._footer.unlink(missing_ok=True)
        header_text = json.dumps(header, sort_keys=True)
        metadata = {"detrace.schema": SCHEMA_VERSION, "detrace.header": header_text}
        try:
            self._file = open(self.path, "wb")  # noqa: SIM115 - kept open for the life of the writer
        except OSError as err:
            raise TraceError(f"cannot write trace file {self.path}: {err.strerror}") from None
        self._writer = pa.ipc.new_file(self._file, ARROW_SCHEMA.with_metadata(metadata))
        self._rows: list[dict[str, Any]] = []
        self._checked_schema: pa.Schema | None = None
        self._last_flush = time.monotonic()
        self.records = 0
        self.batches = 0
        self._chain = chain_start(header_text.encode())
        self.last_step = -1
        self.closed = False

    def add(self, row: dict[str, Any]) -> None:
        """Buffer one record (keys are schema field names; nullable fields may be omitted)."""
        self._rows.append(row)
        self.records += 1
        self.last_step = row["step"]
        if len(self._rows) >= self.batch_records or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def add_batch(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Write many records at once (columnar, for bulk producers); buffered rows are flushed first."""
        if batch.schema is not self._checked_schema:  # bulk producers reuse one schema object: check it once
            if not batch.schema.equals(ARROW_SCHEMA, check_metadata=False):
                raise TraceError("record batch does not match the trace schema")
            self._checked_schema = batch.schema
        self.flush()
        if batch.num_rows == 0:
            return
        self._write(batch)
        self.records += batch.num_rows
        self.last_step = int(batch.column("step")[-1].as_py())

    def flush(self) -> None:
        """Write buffered records as one batch and hand them to the OS (they survive a SIGKILL)."""
        self._last_flush = time.monotonic()
        if not self._rows or self.closed:
            return
        rows, self._rows = self._rows, []
        columns = [column([row.get(name) for row in rows], ARROW_SCHEMA.field(name).type) for name in COLUMN_NAMES]
        self._write(pa.record_batch(columns, schema=ARROW_SCHEMA))

    def _write(self, batch: pa.RecordBatch | pa.Table) -> None:
        for part in batch.to_batches() if isinstance(batch, pa.Table) else [batch]:
            metadata, self._chain = seal(part, self.batches, self._chain)
            self._writer.write_batch(part, custom_metadata=metadata)
            self.batches += 1
        self._file.flush()

    def close(self, footer: dict[str, Any] | None = None) -> None:
        """Flush, finish the Arrow file, and write the rank footer that marks the rank complete."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        self._writer.close()
        self._file.close()
        payload = {"schema": SCHEMA_VERSION, "rank": self.rank, "records": self.records,
                   "last_step": self.last_step, "complete": True, **(footer or {}),
                   "batches": self.batches, "chain": chain_text(self._chain)}
        arrow_footer = arrow_footer_checksum(self.path)
        if arrow_footer is not None:  # what Arrow's file readers read beyond the sealed batches
            payload["arrow_footer"] = chain_text(arrow_footer)
        write_json_atomic(self._footer, payload)
