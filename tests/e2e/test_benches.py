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


def test_the_fingerprint_and_checkpoint_benches_run_and_print_their_figures_last() -> None:
    fingerprint = subprocess.run([sys.executable, str(BENCH / "fingerprint.py"), "--rounds", "2", "--fresh", "0",
                                  "--sizes", "1", "--pool-mib", "4"], capture_output=True, text=True, timeout=300)
    assert fingerprint.returncode == 0, fingerprint.stdout[-2000:] + fingerprint.stderr[-2000:]
    figures = [line.split(":")[0] for line in fingerprint.stdout.strip().splitlines()]
    pairs = ("fp2/sum", "fp2/fp1", "fp2/hash_tensor", "fp1/sum")
    per_core = [f"per core {pair} {dtype} 1MiB {where}" for dtype in ("float32", "bfloat16")
                for where in ("from memory", "in cache") for pair in pairs]
    assert figures[-len(per_core):] == per_core or figures[-2 * len(per_core):-len(per_core)] == per_core
    checkpoint = subprocess.run([sys.executable, str(BENCH / "checkpoint.py"), "--gib", "0.01", "--rounds", "2"],
                                capture_output=True, text=True, timeout=300)
    assert checkpoint.returncode == 0, checkpoint.stdout[-2000:] + checkpoint.stderr[-2000:]
    figures = checkpoint.stdout.strip().splitlines()[-3:]
    assert [line.split(":")[0] for line in figures] == [
        "verify/read warm 1 core", "verify/read warm all cores", "save with manifest/plain DCP save"]
    assert not list(Path("/tmp").glob("detrace-ckpt-bench-*"))  # the bench deletes what it wrote
