"""Real runs that several test modules read, made once per test session (session-scoped fixtures in conftest.py).

Each scenario is a set of traced runs of one small script; the tests that use one only read it. A module that must
change a run copies it first.
"""

from __future__ import annotations

import sys
from pathlib import Path

from detrace.launch.launcher import run_traced

GATHER = Path(__file__).parent / "scripts" / "train_gather.py"
"""A small training loop that gathers rows with repeated indices (its backward races at 2 threads)."""

STEADY = ["3", "--small", "--deterministic"]
"""train_gather.py's arguments for a deterministic run of 3 steps."""


def traced_runs(folder: Path, *variants: tuple[str, list[str]], rung: str = "semantic") -> dict[str, Path]:
    """Each variant (name, train_gather.py arguments) traced into folder/name."""
    out = {}
    for name, args in variants:
        result = run_traced([sys.executable, str(GATHER), *args], folder / name, rung=rung, quiet=True, timeout=300)
        assert result.returncode == 0, result.output_tail
        out[name] = folder / name
    return out
