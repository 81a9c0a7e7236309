"""The benches the README quotes still run (each at a tiny size): a bench that rots silently leaves a README
figure nobody can reproduce. bench/gpu_check.py is run by tests/integration/test_ops.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"


def test_the_diff_bench_runs_and_finds_its_planted_origin() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "diff.py"), "--ranks", "4", "--records", "500"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-3].startswith("records/s: ") and lines[-2].startswith("peak memory (RSS): ")
    assert lines[-1].startswith("wall time: ")
    assert any(line.startswith("diff exit 1: verdict diverged, origin ranks [") for line in lines)
