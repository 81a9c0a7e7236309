"""Parallel layouts by name: named mesh dimensions joined by `x`.

    fsdp2xtp2   FSDP over 2 ranks, tensor parallelism over 2 (4 processes)
    pp2xdp2     2 pipeline stages, each data-parallel over 2
    ep2, tp4    one dimension
    2x2         D x T: data parallelism D by tensor parallelism T (the older form; `dp2xtp2`)

Whatever the order in the name, the device mesh is built outermost first in the order of `DIMS` (torchtitan's:
pipeline, data replicate, data shard, expert, tensor), so tensor parallelism is innermost (neighbouring ranks).
`detrace check-topology --layouts A,B` runs CMD on each layout's world size with the name in `LAYOUT_ENV`; the
reference trainer reads it (`--parallel invariant`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from detrace._numbers import parse_count
from detrace.errors import UsageError

__all__ = ["DATA_DIMS", "DIMS", "LAYOUT_ENV", "Layout"]

DIMS = ("pp", "dp", "fsdp", "ep", "tp")
"""The dimensions a layout may name, outermost first: pipeline stages, data-parallel replicas, FSDP shards, expert
parallelism, tensor parallelism."""

DATA_DIMS = ("dp", "fsdp", "ep")
"""The dimensions over which the global batch's microbatches are split (a rank computes the block of its coordinate
over them); the others split the model. Expert parallelism splits the experts and, as in torchtitan, the data of
every other layer: its ranks compute different microbatches."""

LAYOUT_ENV = "DETRACE_LAYOUT"
"""`detrace check-topology --layouts A,B` runs CMD with this variable set to the layout's name."""

_PART = re.compile(r"(pp|dp|fsdp|ep|tp)([0-9]+)")
_OLD = re.compile(r"([0-9]+)x([0-9]+)")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout: the size of each named mesh dimension. `Layout.parse("fsdp2xtp2")`."""

    name: str
    """The name it was written as, its sizes without leading zeros (how verdicts and run directories name it)."""
    sizes: tuple[tuple[str, int], ...]
    """(dimension, size) for each dimension named, outermost first (the order of `DIMS`)."""

    def __post_init__(self) -> None:
        dims = [dim for dim, _ in self.sizes]
        if not dims:
            raise UsageError(f"layout {self.name!r} names no dimension")
        if any(dim not in DIMS for dim in dims):
            raise UsageError(f"layout {self.name!r}: a dimension must be one of {', '.join(DIMS)}")
        if len(set(dims)) != len(dims):
            raise UsageError(f"layout {self.name!r} names a dimension twice")
        if dims != sorted(dims, key=DIMS.index):
            raise UsageError(f"layout {self.name!r}: its sizes must be listed in the order {', '.join(DIMS)}")
        for dim, size in self.sizes:
            if size < 1:
                raise UsageError(f"layout {self.name!r}: {dim} must be 1 or more, not {size}")
            # The fixed trees split a dimension's block in halves; pipeline stages are any number.
            if dim != "pp" and size & (size - 1):
                raise UsageError(f"layout {self.name!r}: {dim} must be a power of two, not {size}")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`fsdp2xtp2`, `pp2xdp2`, `ep2`, `tp4`, or `DxT` (data by tensor parallelism) -> the layout."""
        name = text.strip()
        old = _OLD.fullmatch(name)
        if old is not None:
            dp, tp = _size(old[1], name), _size(old[2], name)
            # The name is rebuilt from the sizes, so that 02x2 and 2x2 are one layout (one run, one directory).
            return cls(name=f"{dp}x{tp}", sizes=(("dp", dp), ("tp", tp)))
        parts = [_PART.fullmatch(part) for part in name.split("x")]
        if not name or any(part is None for part in parts):
            raise UsageError(f"a layout is named dimensions joined by x, such as fsdp2xtp2, pp2xdp2, ep2 or 2x2 "
                             f"(dimensions {', '.join(DIMS)}), not {text!r}")
        named = [(part[1], _size(part[2], name)) for part in parts if part is not None]
        dims = [dim for dim, _ in named]
        if len(set(dims)) != len(dims):
            raise UsageError(f"layout {text!r} names a dimension twice")
        return cls(name="x".join(f"{dim}{size}" for dim, size in named),
                   sizes=tuple(sorted(named, key=lambda pair: DIMS.index(pair[0]))))

    def size(self, dim: str) -> int:
        """The size of `dim`: 1 when the layout does not name it."""
        return dict(self.sizes).get(dim, 1)

    @property
    def world(self) -> int:
        """The processes the layout takes."""
        return math.prod(size for _, size in self.sizes)

    @property
    def dims(self) -> frozenset[str]:
        """The dimensions larger than 1."""
        return frozenset(dim for dim, size in self.sizes if size > 1)

    @property
    def data(self) -> int:
        """How many blocks the global batch's microbatches are split into: the product of the data dimensions."""
        return math.prod(self.size(dim) for dim in DATA_DIMS)

    def data_block(self, rank: int) -> int:
        """The block of microbatches global rank `rank` computes: its coordinate over the data dimensions of the
        mesh (row-major, in the order of `DIMS`; they are neighbours there)."""
        if not 0 <= rank < self.world:
            raise UsageError(f"rank {rank} is not one of layout {self.name}'s {self.world} ranks")
        inner = math.prod(self.size(dim) for dim in DIMS[DIMS.index(DATA_DIMS[-1]) + 1:])
        return (rank // inner) % self.data

    def __str__(self) -> str:
        return self.name


def _size(digits: str, name: str) -> int:
    """A size in a layout's name (ASCII digits, by the name's pattern): too many digits to be a number is one
    sentence, not int()'s ValueError."""
    size = parse_count(digits)
    if size is None:
        raise UsageError(f"a layout's sizes are numbers of processes, and layout {name[:24]}... has one of "
                         f"{len(digits)} digits")
    return size
