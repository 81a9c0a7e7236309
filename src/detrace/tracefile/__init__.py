"""The trace format: where the recording wing (detrace.record) and the analysis wing (detrace.analyze) meet.

A run directory holds one append-only Apache Arrow IPC file per rank (`rank-00000.arrow`), a per-rank footer
written atomically when the rank closes cleanly (`rank-00000.json`), and optionally a run header written by the
launcher (`run.json`). Nothing else in detrace reads or writes these files directly.
"""

from detrace.tracefile.layout import footer_path, rank_path, run_header_path
from detrace.tracefile.reader import RankFile, RankTrace, RunInfo, iter_batches, open_run, read_rank
from detrace.tracefile.schema import (
    ARROW_SCHEMA,
    FIELDS,
    PHASES,
    ROLES,
    RUNGS,
    SCHEMA_VERSION,
    rung_includes,
)
from detrace.tracefile.writer import RankWriter, write_json_atomic

# The capture format needs torch; everything else here needs only pyarrow. Loading it lazily keeps the
# analysis wing's worker processes from paying torch's import time and memory.
_CAPTURE_NAMES = ("Capture", "load_capture", "resolve_op", "save_capture")


def __getattr__(name: str) -> object:
    if name in _CAPTURE_NAMES:
        from detrace.tracefile import capture

        return getattr(capture, name)
    raise AttributeError(f"module 'detrace.tracefile' has no attribute {name!r}")

__all__ = [
    "ARROW_SCHEMA",
    "FIELDS",
    "PHASES",
    "ROLES",
    "RUNGS",
    "SCHEMA_VERSION",
    "Capture",
    "RankFile",
    "RankTrace",
    "RankWriter",
    "RunInfo",
    "footer_path",
    "iter_batches",
    "load_capture",
    "open_run",
    "rank_path",
    "read_rank",
    "resolve_op",
    "run_header_path",
    "rung_includes",
    "save_capture",
    "write_json_atomic",
]
