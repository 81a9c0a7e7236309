"""Step and rank windows: the SPEC grammar shared by the CLI, the tracer and certify.

SPEC := "all" | item ("," item)*
item := N | A-B | [A]::K      (every K-th value starting at A, default 0)
"""

from __future__ import annotations

from dataclasses import dataclass

from detrace.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Window:
    """A set of non-negative integers (steps or ranks), parsed from a SPEC string."""

    spec: str
    """The SPEC string this window was parsed from, kept for headers and messages."""
    everything: bool = False
    """True for "all"."""
    points: frozenset[int] = frozenset()
    """Single values and expanded ranges."""
    strides: tuple[tuple[int, int], ...] = ()
    """(start, every) pairs from "A::K" items."""

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int) or value < 0:
            return False
        if self.everything or value in self.points:
            return True
        return any(value >= start and (value - start) % every == 0 for start, every in self.strides)

    @property
    def bounded(self) -> bool:
        """Whether the window is a finite set (no "all", no stride)."""
        return not self.everything and not self.strides

    def expand(self, upto: int | None = None) -> list[int]:
        """The sorted members below `upto` (required when the window is unbounded)."""
        if self.bounded:
            return sorted(v for v in self.points if upto is None or v < upto)
        if upto is None:
            raise UsageError(f"window {self.spec!r} is unbounded; give an upper limit")
        return [v for v in range(upto) if v in self]

    def __str__(self) -> str:
        return self.spec


ALL = Window(spec="all", everything=True)


def _int(text: str, spec: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise UsageError(f"malformed SPEC {spec!r}: {text!r} is not a non-negative integer")
    return int(text)


def parse_window(spec: str) -> Window:
    """Parse a SPEC string ("all", "3", "2-5", "0,3,8-15", "::10", "4::2") into a Window."""
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError("malformed SPEC: it is empty (use 'all', '3', '2-5', '0,3,8-15' or '::10')")
    text = spec.strip()
    if text == "all":
        return ALL
    points: set[int] = set()
    strides: list[tuple[int, int]] = []
    for item in text.split(","):
        if "::" in item:
            start, _, every = item.partition("::")
            k = _int(every, spec)
            if k == 0:
                raise UsageError(f"malformed SPEC {spec!r}: the stride in {item!r} must be at least 1")
            strides.append((_int(start, spec) if start.strip() else 0, k))
        elif "-" in item:
            lo, _, hi = item.partition("-")
            a, b = _int(lo, spec), _int(hi, spec)
            if b < a:
                raise UsageError(f"malformed SPEC {spec!r}: range {item!r} runs backwards")
            points.update(range(a, b + 1))
        else:
            points.add(_int(item, spec))
    return Window(spec=text, points=frozenset(points), strides=tuple(strides))
