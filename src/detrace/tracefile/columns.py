"""Arrow arrays built from Python values without `pyarrow.array`.

`pyarrow.array` imports pandas the first time it runs, whenever pandas is installed (to recognise pandas objects
among its arguments): 0.3-0.6 s and tens of MB in every traced process, for values that are never pandas objects.
`column` lays out the same Arrow buffers from NumPy arrays and hands them to `pyarrow.Array.from_buffers`;
tests/unit/test_columns.py checks it against `pyarrow.array` on arbitrary values of every type it takes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

import numpy as np
import pyarrow as pa

_NUMBERS: dict[pa.DataType, type[np.generic]] = {
    pa.int64(): np.int64, pa.int32(): np.int32, pa.uint64(): np.uint64, pa.float64(): np.float64,
}


def column(values: Sequence[Any], arrow_type: pa.DataType) -> pa.Array:
    """The Arrow array of `values` (None is null) of `arrow_type`: int64, int32, uint64, float64, bool, string, or a
    list of one of the numbers. A value that does not fit the type raises TypeError, ValueError or OverflowError."""
    n = len(values)
    # Identity tests by map (C calls, no Python frame per value): most of the time of a trace's columns.
    nulls = np.fromiter(map(operator.is_, values, repeat(None)), dtype=bool, count=n)
    null_count = int(nulls.sum())
    validity = pa.py_buffer(np.packbits(~nulls, bitorder="little")) if null_count else None
    if pa.types.is_list(arrow_type):
        items = list(chain.from_iterable(values)) if not null_count else [item for value in values
                                                                          if value is not None for item in value]
        offsets = _offsets(map(len, values) if not null_count else (0 if value is None else len(value)
                                                                       for value in values))
        return pa.Array.from_buffers(arrow_type, n, [validity, offsets], null_count,
                                     children=[column(items, arrow_type.value_type)])
    if arrow_type == pa.string():
        if not null_count:
            text = "".join(values)
            joined = text.encode()
            if len(joined) == len(text):  # ASCII (names of modules and ops): a string's bytes are its characters
                return pa.Array.from_buffers(arrow_type, n, [None, _offsets(map(len, values)),
                                                             pa.py_buffer(joined)], 0)
        encoded = [b"" if value is None else value.encode() for value in values]
        data = pa.py_buffer(b"".join(encoded))
        return pa.Array.from_buffers(arrow_type, n, [validity, _offsets(map(len, encoded)), data], null_count)
    if arrow_type == pa.bool_():
        bits = np.packbits(np.fromiter((bool(value) for value in values), dtype=bool, count=n), bitorder="little")
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(bits)], null_count)
    if arrow_type not in _NUMBERS:
        raise TypeError(f"no column of {arrow_type}")
    data = np.array(values if not null_count else [0 if value is None else value for value in values],
                    dtype=_NUMBERS[arrow_type])
    return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(data)], null_count)


def _offsets(lengths: Any) -> pa.Buffer:
    """Arrow's 32-bit offsets of consecutive items of the given lengths: 0, then their running sum."""
    ends = np.cumsum(np.fromiter(lengths, dtype=np.int64))
    if len(ends) and ends[-1] > np.iinfo(np.int32).max:
        raise OverflowError(f"{ends[-1]} items or bytes in one column: more than 32-bit offsets hold")
    return pa.py_buffer(np.concatenate([np.zeros(1, np.int64), ends]).astype(np.int32))
