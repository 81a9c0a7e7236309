"""The exact metric values a run recorded (role "metric"): what `spikes`, `ablate`, `compare` (the noise test) and
the report's curves read.

A step's value of a metric is the mean of its records in that step: under gradient accumulation the metrics rung
records the loss of every micro-batch (each backward), and the last one alone would hide a spike in the others
(a framework's own logged value, such as HF's "hf/loss", is one record per step and read as it is). A record's
value is exact, and so is the mean of one; of several it is their correctly rounded sum (`math.fsum`) divided by
their count, the same bits on every machine. A NaN or an infinity stays one in the mean.

A trace whose metric steps go back (a restarted process appended to the same trace) is refused, never read as one
run: its later records would overwrite or be averaged with the earlier ones of the same step.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict
from pathlib import Path

import pyarrow.compute as pc

from detrace.errors import TraceError
from detrace.tracefile import open_run, read_rank


def step_mean(values: list[float]) -> float:
    """The mean of one step's records of a metric (see the module's docstring)."""
    if len(values) == 1:
        return values[0]
    if not all(math.isfinite(v) for v in values):
        return sum(values) / len(values)  # NaN or +-inf, as the values give it (fsum refuses inf - inf)
    return math.fsum(values) / len(values)


def same_bits(a: float | None, b: float | None) -> bool:
    """Whether two metric values have the same bits (a NaN equals itself here, as `==` would not say; -0.0 and 0.0
    differ)."""
    if a is None or b is None:
        return a is b
    return struct.pack("<d", a) == struct.pack("<d", b)


def metric_series(run_dir: str | Path, rank: int) -> dict[str, dict[int, float]]:
    """Exact metric values of one rank: name -> step -> the step's value (the mean of its records). Raises
    TraceError when a metric's steps go back in the rank's execution order."""
    table = read_rank(run_dir, rank).table
    table = table.filter(pc.equal(table["role"], "metric")).select(["step", "name", "value"])
    records: dict[str, dict[int, list[float]]] = defaultdict(dict)
    last: dict[str, int] = {}
    for row in table.to_pylist():
        name, step = row["name"], row["step"]
        if step < last.get(name, step):
            raise TraceError(
                f"{run_dir} rank {rank} holds a restarted run: its {name!r} records go back from step {last[name]} "
                f"to step {step}, so two runs were appended to one trace; trace each run into a directory of its own "
                "(`detrace run --out`)")
        last[name] = step
        if row["value"] is not None:
            records[name].setdefault(step, []).append(row["value"])
    return {name: {step: step_mean(values) for step, values in steps.items()} for name, steps in records.items()}


def metric_rank(run_dir: str | Path) -> int | None:
    """The lowest rank that recorded metrics (ranks outside the recorded window have no file)."""
    for rank in open_run(run_dir).ranks:
        if metric_series(run_dir, rank):
            return rank
    return None
