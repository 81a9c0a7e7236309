"""The exact metric values a run recorded (role "metric"): what the noise test and the report's curves read."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow.compute as pc

from detrace.tracefile import open_run, read_rank


def metric_series(run_dir: str | Path, rank: int) -> dict[str, dict[int, float]]:
    """Exact metric values of one rank: name -> step -> value."""
    table = read_rank(run_dir, rank).table
    table = table.filter(pc.equal(table["role"], "metric")).select(["step", "name", "value"])
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for row in table.to_pylist():
        if row["value"] is not None:
            series[row["name"]][row["step"]] = row["value"]
    return dict(series)


def metric_rank(run_dir: str | Path) -> int | None:
    """The lowest rank that recorded metrics (ranks outside the recorded window have no file)."""
    for rank in open_run(run_dir).ranks:
        if metric_series(run_dir, rank):
            return rank
    return None
