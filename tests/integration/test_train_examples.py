"""The standalone example scripts under examples/: plain PyTorch, no detrace import, they run (in this process, as
`python examples/plain_moe_train.py` runs them; `detrace check` runs it in real processes in the README tour,
tests/e2e/test_readme_tour.py)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "plain_moe_train.py"


def _run(monkeypatch: pytest.MonkeyPatch, *args: str) -> list[str]:
    """The lines the script prints, run as __main__ with `args`."""
    printed = io.StringIO()
    with monkeypatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(sys, "argv", [str(SCRIPT), *args])
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return printed.getvalue().splitlines()


def test_plain_script_does_not_import_detrace() -> None:
    assert "detrace" not in "\n".join(
        line for line in SCRIPT.read_text().splitlines() if line.startswith(("import", "from"))
    )


def test_plain_script_trains_and_is_bit_identical_when_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _run(monkeypatch, "--steps", "3", "--deterministic")
    assert [line.split()[1] for line in first] == ["0", "1", "2"]  # steps count from 0, as detrace counts them
    assert first == _run(monkeypatch, "--steps", "3", "--deterministic")
