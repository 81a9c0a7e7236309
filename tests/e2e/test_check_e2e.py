"""`detrace check` end to end, as a user types it: a real script, run twice in processes of their own. Its verdicts'
logic is tested in process (tests/unit); a racing script's `diverged` is the README tour's (test_readme_tour.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "plain_moe_train.py"


@pytest.mark.slow
def test_a_deterministic_script_is_identical_in_two_runs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "detrace", "check", "--out", str(tmp_path / "check"), "--",
                           sys.executable, str(EXAMPLE), "--steps", "2", "--threads", "2", "--deterministic"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("identical: 2 runs are bit-identical"), done.stdout
    assert sorted(path.name for path in (tmp_path / "check").iterdir() if path.is_dir()) == ["run-0", "run-1"]
