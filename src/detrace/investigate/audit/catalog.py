"""The catalog of ATen ops whose result depends on scheduling: data, one `OpEntry` per op.

An entry says on which device types the op's kernel races (atomic adds, or threads adding into one place),
when it does (always, or only when indices repeat), what removes it, and where we know it from:

- `torch-alert`: torch's own list, the ops that `torch.use_deterministic_algorithms(True, warn_only=True)`
  warns about (their nondeterministic CUDA kernels; see torch.use_deterministic_algorithms' documentation);
- `replay`: measured by `detrace replay`/`locate` on this project's machines (CPU index accumulation races at
  2+ threads, which torch's alerts do not mention);
- `detrace.ops`: the ops `detrace.deterministic(kernels="detrace")` routes to detrace's own kernels.

Extend it by adding an `OpEntry` to `ENTRIES` (docs/audit.md shows how); `tests/integration/test_audit.py` checks
that every name is an ATen op of the installed torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from detrace.investigate.audit.records import Fixer

Repeats = Literal["", "index-list", "flat", "along-dim"]
"""How the indices an op accumulates through are read: `index-list` (index_put's list of index tensors, one per
indexed dimension), `flat` (one index tensor, every entry a destination), `along-dim` (scatter's index, whose
entries are destinations along `dim` within each line); "" for ops that race whatever their inputs."""


@dataclass(frozen=True, kw_only=True)
class OpEntry:
    """One op whose result may depend on scheduling."""

    op: str
    """The ATen op without overload ("index_put_"): every overload of it is judged."""
    devices: tuple[str, ...]
    """Device types whose kernel races ("cpu": with 2+ threads; "cuda": always, atomics)."""
    indices: str = ""
    """The schema argument holding the indices it accumulates through; "" when it races whatever they are."""
    repeats: Repeats = ""
    """How `indices` is read (see `Repeats`)."""
    requires: str = ""
    """A boolean schema argument that must be true for the op to accumulate ("accumulate"); "" for none."""
    fixed_by: Fixer = "deterministic"
    """What removes it: torch.use_deterministic_algorithms (`deterministic`), also detrace's kernel routes
    (`kernels`, on the devices of detrace.ops.routing.ROUTES), or a code change."""
    source: str
    """Where we know it from: torch-alert, replay, detrace.ops (comma-separated)."""
    why: str
    """What races, in one clause."""

    def __post_init__(self) -> None:
        if not self.op or not self.devices or not self.source or not self.why:
            raise ValueError(f"catalog entry {self.op!r} needs an op, devices, a source and a why")
        if bool(self.indices) != bool(self.repeats):
            raise ValueError(f"catalog entry {self.op!r}: `indices` and `repeats` go together")


_ACCUMULATE = "adds values with atomics (CUDA) or from several threads (CPU) into destinations that indices share"
_SCATTER = "adds values with atomic adds into destinations that indices share"
_BACKWARD = "accumulates gradients with atomic adds into overlapping input positions"

ENTRIES: Final[tuple[OpEntry, ...]] = (
    # Index accumulation: `x[i] += v`, index_put_(accumulate=True) and the backward of `x[i]` (index_backward).
    OpEntry(op="index_put_", devices=("cpu", "cuda"), indices="indices", repeats="index-list",
            requires="accumulate", fixed_by="kernels", source="torch-alert,replay,detrace.ops", why=_ACCUMULATE),
    OpEntry(op="index_put", devices=("cpu", "cuda"), indices="indices", repeats="index-list",
            requires="accumulate", fixed_by="kernels", source="torch-alert,replay,detrace.ops", why=_ACCUMULATE),
    OpEntry(op="_index_put_impl_", devices=("cpu", "cuda"), indices="indices", repeats="index-list",
            requires="accumulate", fixed_by="kernels", source="torch-alert,replay,detrace.ops", why=_ACCUMULATE),
    OpEntry(op="put_", devices=("cpu", "cuda"), indices="index", repeats="flat", requires="accumulate",
            source="torch-alert,replay", why=_ACCUMULATE),
    OpEntry(op="put", devices=("cpu", "cuda"), indices="index", repeats="flat", requires="accumulate",
            source="torch-alert,replay", why=_ACCUMULATE),
    OpEntry(op="index_add_", devices=("cuda",), indices="index", repeats="flat", fixed_by="kernels",
            source="torch-alert,detrace.ops", why=_SCATTER),
    OpEntry(op="index_add", devices=("cuda",), indices="index", repeats="flat", fixed_by="kernels",
            source="torch-alert,detrace.ops", why=_SCATTER),
    OpEntry(op="scatter_add_", devices=("cuda",), indices="index", repeats="along-dim", fixed_by="kernels",
            source="torch-alert,detrace.ops", why=_SCATTER),
    OpEntry(op="scatter_add", devices=("cuda",), indices="index", repeats="along-dim", fixed_by="kernels",
            source="torch-alert,detrace.ops", why=_SCATTER),
    OpEntry(op="scatter_reduce_", devices=("cuda",), indices="index", repeats="along-dim", source="torch-alert",
            why=_SCATTER),
    OpEntry(op="scatter_reduce", devices=("cuda",), indices="index", repeats="along-dim", source="torch-alert",
            why=_SCATTER),
    OpEntry(op="index_reduce_", devices=("cuda",), indices="index", repeats="flat", source="torch-alert",
            why=_SCATTER),
    OpEntry(op="embedding_dense_backward", devices=("cuda",), indices="indices", repeats="flat",
            source="torch-alert", why="adds the gradients of repeated tokens with atomic adds"),
    OpEntry(op="_embedding_bag_backward", devices=("cuda",), indices="indices", repeats="flat",
            source="torch-alert", why="adds the gradients of repeated bag entries with atomic adds"),
    # Backward kernels whose windows overlap: atomics whatever the input.
    OpEntry(op="upsample_linear1d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="upsample_bilinear2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="upsample_bicubic2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="upsample_trilinear3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="_adaptive_avg_pool2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="_adaptive_avg_pool3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="adaptive_max_pool2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="avg_pool3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="max_pool3d_with_indices_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="fractional_max_pool2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="fractional_max_pool3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="reflection_pad1d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="reflection_pad2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="reflection_pad3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="replication_pad1d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="replication_pad2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="replication_pad3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="grid_sampler_2d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="grid_sampler_3d_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="_ctc_loss_backward", devices=("cuda",), source="torch-alert", why=_BACKWARD),
    OpEntry(op="nll_loss2d_forward", devices=("cuda",), source="torch-alert",
            why="sums the per-pixel losses with atomic adds"),
    OpEntry(op="histc", devices=("cuda",), source="torch-alert", why="counts into bins with atomic adds"),
    OpEntry(op="bincount", devices=("cuda",), source="torch-alert",
            why="adds weights into bins with atomic adds"),
    OpEntry(op="kthvalue", devices=("cuda",), source="torch-alert",
            why="returns the index of one of several equal values, whichever thread wins"),
    OpEntry(op="median", devices=("cuda",), source="torch-alert",
            why="returns the index of one of several equal values, whichever thread wins"),
)

BY_OP: Final[dict[str, OpEntry]] = {entry.op: entry for entry in ENTRIES}
"""The catalog by op name (no overload), as the probe looks it up for every call."""
