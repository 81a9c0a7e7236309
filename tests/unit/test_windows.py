"""The SPEC grammar for step and rank windows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace.errors import UsageError
from detrace.tracefile.selection import Members, describe_runs, parse_window


def test_all_contains_every_non_negative_integer() -> None:
    window = parse_window("all")
    assert 0 in window and 10**9 in window
    assert -1 not in window
    assert not window.bounded


@pytest.mark.parametrize(
    ("spec", "members"),
    [("3", [3]), ("2-5", [2, 3, 4, 5]), ("0,3,8-10", [0, 3, 8, 9, 10]), (" 1 , 1 ", [1])],
)
def test_bounded_specs_expand_to_their_members(spec: str, members: list[int]) -> None:
    window = parse_window(spec)
    assert window.bounded
    assert window.expand() == members
    assert all(m in window for m in members)
    assert max(members) + 1 not in window


def test_strides() -> None:
    assert parse_window("::10").expand(35) == [0, 10, 20, 30]
    assert parse_window("4::3").expand(14) == [4, 7, 10, 13]
    assert parse_window("1,::5").expand(12) == [0, 1, 5, 10]


def test_unbounded_expand_needs_a_limit() -> None:
    with pytest.raises(UsageError, match="unbounded"):
        parse_window("::2").expand()


@pytest.mark.parametrize("spec", ["", "  ", "x", "3-1", "1-", "-1", "::0", "1,,2", "a::2", "2.5"])
def test_malformed_specs_name_the_problem(spec: str) -> None:
    with pytest.raises(UsageError, match="SPEC"):
        parse_window(spec)


@settings(deadline=None)  # a loaded shared machine can stall any example past hypothesis' 200 ms
@given(st.sets(st.integers(0, 500), min_size=1, max_size=20))
def test_comma_lists_round_trip(values: set[int]) -> None:
    window = parse_window(",".join(str(v) for v in sorted(values)))
    assert window.expand() == sorted(values)


@pytest.mark.parametrize("spec", ["0-99999999999999999999", "5-30000000,::7,3::1000000000000"])
def test_huge_ranges_are_interval_arithmetic(spec: str) -> None:
    """F1: membership, counting and runs cost the SPEC's length, not the ranges' size (9 GB in 43 s before)."""
    window = parse_window(spec)
    assert 10**19 in window if spec.startswith("0-") else 29_999_999 in window
    assert window.count(10**12) > 10**9


def test_count_runs_and_missing_agree_with_expansion() -> None:
    window = parse_window("2-9,::3,1::4,20-22")
    members = [v for v in range(40) if v in window]
    assert window.expand(40) == members and window.count(40) == len(members)
    assert window.missing([3, 4, 100], 40) == (len(members) - 2, [(0, 2), (5, 9), (12, 13), (15, 15), (17, 18),
                                                                 (20, 22), (24, 25), (27, 27)])
    assert describe_runs(*window.missing([], 13)) == "0-9,12"
    assert describe_runs(*window.missing([], 40)).endswith(",...")
    sequence = Members(window, 40)
    assert sequence == members and sequence[-1] == members[-1] and len(sequence) == len(members)


@settings(deadline=None)
@given(st.sampled_from(["all", "2-9,::3,1::4,20-22", "5::2", "0,7-12"]), st.sets(st.integers(0, 45)),
       st.integers(0, 45))
def test_missing_from_a_start_step_matches_brute_force(spec: str, present: set[int], start: int) -> None:
    window = parse_window(spec)
    expected = [v for v in range(start, 40) if v in window and v not in present]
    count, runs = window.missing(present, 40, start=start)
    assert count == len(expected)
    assert [v for lo, hi in runs for v in range(lo, hi + 1)] == expected[: len([v for lo, hi in runs
                                                                               for v in range(lo, hi + 1)])]
    assert (not expected) == (not runs) and (not runs or runs[0][0] == expected[0])


@settings(deadline=None)
@given(st.lists(st.one_of(st.tuples(st.integers(0, 60), st.integers(0, 20)),
                          st.tuples(st.integers(0, 30), st.integers(1, 9)).map(lambda p: f"{p[0]}::{p[1]}")),
                min_size=1, max_size=5), st.integers(0, 120))
def test_count_is_exact(items: list[object], upto: int) -> None:
    spec = ",".join(f"{i[0]}-{i[0] + i[1]}" if isinstance(i, tuple) else str(i) for i in items)
    window = parse_window(spec)
    assert window.count(upto) == sum(1 for v in range(upto) if v in window) == len(window.expand(upto))
