"""`detrace doctor`: not implemented yet (tracked in issue #5)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace doctor' is not available in this build yet (issue #5)")
