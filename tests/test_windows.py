"""The SPEC grammar for step and rank windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detrace.errors import UsageError
from detrace.windows import parse_window


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


@given(st.sets(st.integers(0, 500), min_size=1, max_size=20))
def test_comma_lists_round_trip(values: set[int]) -> None:
    window = parse_window(",".join(str(v) for v in sorted(values)))
    assert window.expand() == sorted(values)
