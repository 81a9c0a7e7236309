"""What the docs quote runs and is true: code snippets run as printed, and quoted output is what a run prints."""

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


def test_the_diff_bench_figures_live_in_one_place() -> None:
    # docs/diff.md quoted other figures of the same bench than the README's table: it now quotes none.
    text = (DOCS / "diff.md").read_text()
    section = text.split("## Speed and memory")[1].split("\n## ")[0]
    assert "the README's Benchmarks table" in section
    assert not re.findall(r"\d[\d,.]* (?:records/s|MiB|GiB|s of CPU)|\| \d", section)
