"""What the ladder reads back from the runs it made: the steps a run recorded and the culprit call's records in
both op-rung runs (the checkpoints a run saved: `detrace.state.contract.saved_versions`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detrace.analyze.locate_result import CallRecord, Finding
from detrace.errors import TraceError
from detrace.tracefile import open_run, read_rank


def recorded_steps(run_dir: Path) -> int:
    """Steps covered by a run: one more than the last step any rank recorded."""
    try:
        info = open_run(run_dir)
    except TraceError as err:
        raise TraceError(f"CMD ran but left no trace in {run_dir} ({err}); is it a Python program that "
                         "trains with torch?") from None
    return 1 + max(read_rank(run_dir, rank).last_step for rank in info.ranks)


def call_records(run_a: str, run_b: str, culprit: Finding) -> list[CallRecord]:
    """The culprit call's records in both runs, side by side: which inputs matched and which outputs did not."""
    def call(run: str) -> dict[tuple[str, int], dict[str, Any]]:
        rows = read_rank(run, culprit.rank).table.to_pylist()
        event = next((r["event"] for r in rows if r["seq"] == culprit.seq), None)
        return {(r["role"], r["index"]): r for r in rows if event is not None and r["event"] == event}

    a, b = call(run_a), call(run_b)
    records = []
    for key in a.keys() | b.keys():
        ra, rb = a.get(key), b.get(key)
        row = ra or rb
        assert row is not None
        records.append(CallRecord(role=key[0], index=key[1], shape=row["shape"], dtype=row["dtype"],
                                  numel=row["numel"], equal=ra is not None and rb is not None
                                  and ra["digest"] == rb["digest"] and ra["shape"] == rb["shape"]))
    order = {"input": 0, "mutated": 1, "output": 2}
    return sorted(records, key=lambda r: (order.get(r.role, 3), r.role, r.index))
