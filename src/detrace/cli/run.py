"""`detrace run`: not implemented yet (tracked in issue #3)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace run' is not available in this build yet (issue #3)")
