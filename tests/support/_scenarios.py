"""Real runs that several test modules read, made once per test session (session-scoped fixtures in conftest.py).

Each scenario is a set of traced runs of one small script; the tests that use one only read it. A module that must
change a run copies it first.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from detrace.launch.launcher import run_traced

GATHER = Path(__file__).parent / "scripts" / "train_gather.py"
"""A small training loop that gathers rows with repeated indices (its backward races at 2 threads)."""

STEADY = ["3", "--small", "--deterministic"]
"""train_gather.py's arguments for a deterministic run of 3 steps."""


def traced_runs(folder: Path, *variants: tuple[str, list[str]], rung: str = "semantic") -> dict[str, Path]:
    """Each variant (name, train_gather.py arguments) traced into folder/name, all at once: the other pytest workers
    that need them wait for them (conftest.steady_runs), with their cores idle."""
    with ThreadPoolExecutor(len(variants)) as pool:
        results = pool.map(lambda variant: run_traced([sys.executable, str(GATHER), *variant[1]], folder / variant[0],
                                                      rung=rung, quiet=True, timeout=300), variants)
        for result in results:
            assert result.returncode == 0, result.output_tail
    return {name: folder / name for name, _ in variants}
