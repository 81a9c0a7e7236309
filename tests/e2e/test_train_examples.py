"""The standalone example scripts under examples/: plain PyTorch, no detrace import, they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "plain_moe_train.py"


def _run(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_plain_script_does_not_import_detrace() -> None:
    assert "detrace" not in "\n".join(
        line for line in SCRIPT.read_text().splitlines() if line.startswith(("import", "from"))
    )


def test_plain_script_trains_and_is_bit_identical_when_deterministic() -> None:
    first = _run("--steps", "3", "--deterministic")
    assert [line.split()[1] for line in first] == ["0", "1", "2"]  # steps count from 0, as detrace counts them
    assert first == _run("--steps", "3", "--deterministic")
