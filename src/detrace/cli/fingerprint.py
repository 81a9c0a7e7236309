"""`detrace fingerprint`: not implemented yet (tracked in issue #2)."""

from __future__ import annotations

from detrace.errors import NotImplementedYet


def main(argv: list[str]) -> int:
    raise NotImplementedYet("'detrace fingerprint' is not available in this build yet (issue #2)")
