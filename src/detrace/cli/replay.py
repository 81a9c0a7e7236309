"""`detrace replay`: not implemented yet (tracked in issue #7)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace replay' is not available in this build yet (issue #7)")
