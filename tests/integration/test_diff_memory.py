"""The diff streams: its peak memory, measured in fresh processes, does not grow with the length of the runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _synthetic import Fault, SyntheticRun, write_run


def test_memory_does_not_grow_with_trace_length(tmp_path: Path) -> None:
    # Peak Arrow allocations and peak Python heap while diffing diverged runs of 4 and of 40 steps, each in a
    # fresh process: a diff that held the run in memory would need ten times more for the longer one.
    script = ("import sys, tracemalloc, pyarrow as pa; from detrace.analyze import diff; tracemalloc.start(); "
              "r = diff(sys.argv[1], sys.argv[2], workers=1); "
              "print(r.compared.records, pa.default_memory_pool().max_memory(), tracemalloc.get_traced_memory()[1])")
    peaks = []
    for steps in (4, 40):
        run = SyntheticRun(ranks=1, steps=steps, ops=256)
        write_run(tmp_path / f"a{steps}", run)
        write_run(tmp_path / f"b{steps}", run, Fault(rank=0, step=1, op=0))
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"a{steps}"), str(tmp_path / f"b{steps}")],
                              capture_output=True, text=True, check=True, timeout=120)
        records, arrow, python = map(int, done.stdout.split())
        assert records == run.records_per_rank
        peaks.append((arrow, python))
    (arrow_short, python_short), (arrow_long, python_long) = peaks
    assert arrow_long < 2 * arrow_short and python_long < 2 * python_short
