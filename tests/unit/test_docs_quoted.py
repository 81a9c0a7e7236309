"""What the docs quote lives in one place (the code snippets that run as printed:
tests/integration/test_docs_snippets.py)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"


def test_the_diff_bench_figures_live_in_one_place() -> None:
    # docs/diff.md quoted other figures of the same bench than the README's table: it now quotes none.
    text = (DOCS / "diff.md").read_text()
    section = text.split("## Speed and memory")[1].split("\n## ")[0]
    assert "the README's Benchmarks table" in section
    assert not re.findall(r"\d[\d,.]* (?:records/s|MiB|GiB|s of CPU)|\| \d", section)
