"""The one parser of non-negative integers written as text (options, SPECs, environment variables, file fields).

`str.isdigit()` is true for superscripts and other Unicode digits ("²") that `int()` refuses, so a check with it
let a ValueError through; `int()` alone accepts signs, underscores and non-ASCII decimal digits. Only ASCII digits
are a number here.
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"[0-9]+")


def parse_count(text: str) -> int | None:
    """The non-negative integer `text` spells in ASCII digits (surrounding whitespace allowed), else None."""
    text = text.strip()
    return int(text) if _DIGITS.fullmatch(text) else None
