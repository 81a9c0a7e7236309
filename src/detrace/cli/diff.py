"""`detrace diff`: not implemented yet (tracked in issue #4)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace diff' is not available in this build yet (issue #4)")
