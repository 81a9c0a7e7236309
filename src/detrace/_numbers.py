"""The one parser of non-negative integers written as text (options, SPECs, environment variables, file fields).

`str.isdigit()` is true for superscripts and other Unicode digits ("²") that `int()` refuses, so a check with it
let a ValueError through; `int()` alone accepts signs, underscores and non-ASCII decimal digits. Only ASCII digits
are a number here. Nor is one longer than Python converts (`sys.get_int_max_str_digits()`, 4300 digits by default):
`int()` raises ValueError on it, and no count anything here reads is that long.
"""

from __future__ import annotations

import re
import sys

_DIGITS = re.compile(r"[0-9]+")


def parse_count(text: str) -> int | None:
    """The non-negative integer `text` spells in ASCII digits (surrounding whitespace allowed), else None."""
    text = text.strip()
    if not _DIGITS.fullmatch(text):
        return None
    digits = text.lstrip("0") or "0"  # leading zeros count against the limit but not in the value
    limit = sys.get_int_max_str_digits()  # 0: no limit
    return int(digits) if not limit or len(digits) <= limit else None
