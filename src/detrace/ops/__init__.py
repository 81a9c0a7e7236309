"""detrace.ops: deterministic kernels that are also fast.

- MoE dispatch with a known fan-out k: `route`, `permute`, `combine` (`detrace.ops.moe`): a private slot per
  (token, choice) and a fixed-order sum, in forward and backward.
- `grouped_mm` (`detrace.ops.grouped`): GEMM over expert-sorted rows with deterministic forward, input and
  weight gradients.
- Index accumulation (`detrace.ops.index`): `index_add`, `index_put_`, `scatter_add`, sort once then a
  segmented fixed-order reduction; `detrace.deterministic(seed, kernels="detrace")` routes torch's own ops there
  where they beat torch's deterministic implementation (`detrace.ops.routing`).
- `detrace.ops.hf_experts.register()`: a "detrace" experts implementation for transformers' MoE models.

On CUDA the kernels are Triton kernels (`detrace.ops._triton`) that keep the same order; elsewhere PyTorch ops.
Every function takes `backend=` ("auto", "torch" or "triton") to choose explicitly.
"""

from __future__ import annotations

from detrace.ops.grouped import grouped_mm
from detrace.ops.index import index_add, index_add_, index_put_, scatter_add, scatter_add_
from detrace.ops.moe import Routing, combine, permute, route

__all__ = [
    "Routing",
    "combine",
    "grouped_mm",
    "index_add",
    "index_add_",
    "index_put_",
    "permute",
    "route",
    "scatter_add",
    "scatter_add_",
]
