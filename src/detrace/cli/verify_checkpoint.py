"""`detrace verify-checkpoint`: not implemented yet (tracked in issue #5)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace verify-checkpoint' is not available in this build yet (issue #5)")
