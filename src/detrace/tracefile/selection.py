"""Step and rank windows: the SPEC grammar shared by the CLI, the tracer and certify.

SPEC := "all" | item ("," item)*
item := N | A-B | [A]::K      (every K-th value starting at A, default 0)

A window is kept as what the SPEC says (merged intervals and arithmetic progressions), never as its members:
membership, counting and the runs of members below a limit cost time in the SPEC's length, not in the size of
the ranges it names, so `0-99999999999999999999` is as cheap as `0-9`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from detrace._numbers import parse_count
from detrace.errors import UsageError

MAX_STRIDES = 8
"""Stride items per SPEC: counting members combines every subset of them (inclusion-exclusion)."""


def _first_at_least(start: int, every: int, lo: int) -> int:
    """The first member of start + k*every (k >= 0) that is at least `lo`."""
    return start if lo <= start else start + -(-(lo - start) // every) * every


def _progression_count(start: int, every: int, lo: int, hi: int) -> int:
    """Members of start + k*every (k >= 0) in [lo, hi]."""
    first = _first_at_least(start, every, lo)
    return 0 if first > hi else (hi - first) // every + 1


def _intersect(p: tuple[int, int], q: tuple[int, int]) -> tuple[int, int] | None:
    """The progression common to two progressions (start, every), or None (Chinese remainder theorem)."""
    (a, m), (b, n) = p, q
    g = math.gcd(m, n)
    if (b - a) % g:
        return None
    lcm = m // g * n
    t = ((b - a) // g * pow(m // g, -1, n // g)) % (n // g) if n // g > 1 else 0
    return _first_at_least(a + m * t, lcm, max(a, b)), lcm


@dataclass(frozen=True, kw_only=True)
class Window:
    """A set of non-negative integers (steps or ranks), parsed from a SPEC string."""

    spec: str
    """The SPEC string this window was parsed from, kept for headers and messages."""
    everything: bool = False
    """True for "all"."""
    intervals: tuple[tuple[int, int], ...] = ()
    """Single values and ranges as inclusive (first, last) pairs: sorted, disjoint, not adjacent."""
    strides: tuple[tuple[int, int], ...] = ()
    """(start, every) pairs from "A::K" items."""

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return False
        if self.everything:
            return True
        i = bisect.bisect_right(self.intervals, (value, math.inf)) - 1
        if i >= 0 and self.intervals[i][0] <= value <= self.intervals[i][1]:
            return True
        return any(value >= start and (value - start) % every == 0 for start, every in self.strides)

    @property
    def bounded(self) -> bool:
        """Whether the window is a finite set (no "all", no stride)."""
        return not self.everything and not self.strides

    def _limit(self, upto: int | None) -> int:
        if upto is not None:
            return upto
        if not self.bounded:
            raise UsageError(f"window {self.spec!r} is unbounded; give an upper limit")
        return self.intervals[-1][1] + 1 if self.intervals else 0

    def count(self, upto: int | None = None) -> int:
        """How many members lie below `upto` (required when the window is unbounded)."""
        end = self._limit(upto) - 1
        if self.everything:
            return max(0, end + 1)
        spans = [(lo, min(hi, end)) for lo, hi in self.intervals if lo <= end]
        total = sum(hi - lo + 1 for lo, hi in spans)
        # members of the strides outside every interval: the strides' count in [0, end] minus within the spans
        for size in range(1, len(self.strides) + 1):
            for subset in itertools.combinations(self.strides, size):
                common: tuple[int, int] | None = subset[0]
                for other in subset[1:]:
                    common = _intersect(common, other) if common is not None else None
                if common is None:
                    continue
                inside = sum(_progression_count(*common, lo, hi) for lo, hi in spans)
                total += (-1) ** (size + 1) * (_progression_count(*common, 0, end) - inside)
        return total

    def runs(self, upto: int | None = None) -> Iterator[tuple[int, int]]:
        """The maximal runs of consecutive members below `upto`, as inclusive (first, last) pairs, lazily."""
        end = self._limit(upto) - 1
        if end < 0:
            return
        if self.everything:
            yield 0, end
            return

        def stride(start: int, every: int) -> Iterator[tuple[int, int]]:
            if every == 1:
                yield start, end
                return
            yield from ((v, v) for v in itertools.takewhile(lambda v: v <= end, itertools.count(start, every)))

        pieces = heapq.merge(((lo, min(hi, end)) for lo, hi in self.intervals if lo <= end),
                             *(stride(s, k) for s, k in self.strides if s <= end))
        current: tuple[int, int] | None = None
        for lo, hi in pieces:
            if current is not None and lo <= current[1] + 1:
                current = (current[0], max(current[1], hi))
                continue
            if current is not None:
                yield current
            current = (lo, hi)
        if current is not None:
            yield current

    def expand(self, upto: int | None = None) -> list[int]:
        """The sorted members below `upto` (required when the window is unbounded). Costs the members' count:
        for small windows only (process groups); use `count`, `runs` or `missing` otherwise."""
        return [v for lo, hi in self.runs(upto) for v in range(lo, hi + 1)]

    def missing(self, present: Iterable[int], upto: int | None = None, *,
                start: int = 0) -> tuple[int, list[tuple[int, int]]]:
        """Members in [start, upto) that are not in `present`: how many, and the first runs of them (at most 8).

        Costs time in the SPEC's length and in the number of `present` values, never in the window's size."""
        end = self._limit(upto)
        seen = sorted({v for v in present if start <= v < end and v in self})
        runs: list[tuple[int, int]] = []
        for lo, hi in self.runs(upto):
            if hi < start:
                continue
            lo = max(lo, start)
            i = bisect.bisect_left(seen, lo)
            while lo <= hi and len(runs) < 8:
                nxt = seen[i] if i < len(seen) and seen[i] <= hi else hi + 1
                if nxt > lo:
                    runs.append((lo, nxt - 1))
                lo, i = nxt + 1, i + 1
            if len(runs) >= 8:
                break
        return self.count(upto) - self.count(min(start, end)) - len(seen), runs

    def __str__(self) -> str:
        return self.spec


ALL = Window(spec="all", everything=True)


class Members(Sequence[int]):
    """The members of a window below a limit, as a read-only sequence that never materializes them."""

    def __init__(self, window: Window, upto: int | None = None) -> None:
        self.window, self.upto = window, upto

    def __len__(self) -> int:
        return self.window.count(self.upto)

    def __iter__(self) -> Iterator[int]:
        return (v for lo, hi in self.window.runs(self.upto) for v in range(lo, hi + 1))

    def __contains__(self, value: object) -> bool:
        return value in self.window and (self.upto is None or value < self.upto)  # type: ignore[operator]

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        if index < 0:
            index += len(self)
        for lo, hi in self.window.runs(self.upto):
            if 0 <= index <= hi - lo:
                return lo + index
            index -= hi - lo + 1
        raise IndexError("window member index out of range")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Members, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=False))

    def __hash__(self) -> int:
        return hash((self.window, self.upto))

    def __repr__(self) -> str:
        return f"Members({self.window.spec!r}, upto={self.upto})"


def describe_runs(count: int, runs: list[tuple[int, int]]) -> str:
    """(12, [(1, 3), (7, 7)]) -> "1-3,7,..." (in the SPEC grammar; "..." when more members follow)."""
    text = ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
    return text + (",..." if count > sum(hi - lo + 1 for lo, hi in runs) else "")


def _int(text: str, spec: str) -> int:
    value = parse_count(text)
    if value is None:
        raise UsageError(f"malformed SPEC {spec!r}: {text.strip()!r} is not a non-negative integer")
    return value


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def parse_window(spec: str) -> Window:
    """Parse a SPEC string ("all", "3", "2-5", "0,3,8-15", "::10", "4::2") into a Window."""
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError("malformed SPEC: it is empty (use 'all', '3', '2-5', '0,3,8-15' or '::10')")
    text = spec.strip()
    if text == "all":
        return ALL
    ranges: list[tuple[int, int]] = []
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
            ranges.append((a, b))
        else:
            value = _int(item, spec)
            ranges.append((value, value))
    strides = sorted(set(strides))
    if len(strides) > MAX_STRIDES:
        raise UsageError(f"malformed SPEC {spec!r}: it has {len(strides)} stride items; at most {MAX_STRIDES}")
    return Window(spec=text, intervals=_merge(ranges), strides=tuple(strides))
