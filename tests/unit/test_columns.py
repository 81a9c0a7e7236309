"""detrace.tracefile.columns: the arrays the tracer writes are the ones `pyarrow.array` builds, for any values of
every type the trace schema holds (that a traced process never imports pandas for them:
tests/integration/test_tracing.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace.tracefile.columns import column
from detrace.tracefile.schema import ARROW_SCHEMA

INT64 = st.integers(-(2**63), 2**63 - 1)
VALUES: dict[pa.DataType, st.SearchStrategy] = {
    pa.int64(): INT64,
    pa.int32(): st.integers(-(2**31), 2**31 - 1),
    pa.uint64(): st.integers(0, 2**64 - 1),
    pa.float64(): st.floats(allow_nan=False) | st.integers(-(2**53), 2**53),
    pa.bool_(): st.booleans(),
    pa.string(): st.text(),
    pa.list_(pa.int64()): st.lists(INT64, max_size=5).map(tuple),
    pa.list_(pa.uint64()): st.lists(st.integers(0, 2**64 - 1), max_size=5),
}


@pytest.mark.parametrize("arrow_type", list(VALUES), ids=str)
@given(data=st.data())
@settings(deadline=None)  # the first call warms pyarrow up: over the 200 ms default on a loaded machine
def test_a_column_is_the_array_pyarrow_builds(arrow_type: pa.DataType, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.none() | VALUES[arrow_type], max_size=40))
    built = column(values, arrow_type)
    built.validate(full=True)
    assert built.equals(pa.array(values, type=arrow_type)) and built.null_count == values.count(None)


def test_every_type_of_the_trace_schema_is_covered() -> None:
    assert {field.type for field in ARROW_SCHEMA} <= set(VALUES)


def test_values_that_do_not_fit_are_refused() -> None:
    with pytest.raises(OverflowError):
        column([2**31], pa.int32())
    with pytest.raises(OverflowError):
        column([-1], pa.uint64())
    with pytest.raises(TypeError, match="no column of"):
        column([1], pa.int8())
