"""Same bits on any layout (public): `data`, the data-parallel sum in one fixed binary tree over microbatches,
whatever the number of ranks (`InvariantDataParallel`, `invariant_backward`); `tensor`, linear layers whose
tensor-parallel sums are fixed trees over model-sized chunks, whatever the TP size (`ColumnParallelLinear`,
`RowParallelLinear`). See docs/topology.md."""

from detrace.parallel.data import InvariantDataParallel, invariant_backward, owned_microbatches, parameters_fingerprint
from detrace.parallel.tensor import ColumnParallelLinear, RowParallelLinear, by_global_name

__all__ = [
    "ColumnParallelLinear",
    "InvariantDataParallel",
    "RowParallelLinear",
    "by_global_name",
    "invariant_backward",
    "owned_microbatches",
    "parameters_fingerprint",
]
