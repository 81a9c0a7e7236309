"""`detrace validate`: not implemented yet (tracked in issue #6)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace validate' is not available in this build yet (issue #6)")
