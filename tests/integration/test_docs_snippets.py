"""What the docs quote runs: code snippets run as printed, each in a process of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"


def quoted(page: str, after: str, lang: str = "python") -> str:
    """The first ```lang block after the line `after` in docs/<page>."""
    text = (DOCS / page).read_text()
    found = re.search(re.escape(after) + r".*?```" + lang + r"\n(.*?)```", text, re.S)
    assert found, f"no {lang} block after {after!r} in docs/{page}"
    return found.group(1)


def test_the_train_state_snippet_runs_as_printed(tmp_path: Path) -> None:
    code = quoted("resume.md", "## The train state") + "assert step == total_steps, step\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr
