"""The catalog of ATen ops whose result depends on scheduling: data, one `OpEntry` per op.

An entry says on which device types the op's kernel races (atomic adds, or threads adding into one place),
when it does (always, or only when indices repeat), what removes it, and where we know it from:

- `torch-alert`: torch's own list, the ops that `torch.use_deterministic_algorithms(True, warn_only=True)`
  warns about (their nondeterministic CUDA kernels; see torch.use_deterministic_algorithms' documentation);
- `replay`: measured by `detrace replay`/`locate` on this project's machines (CPU index accumulation races at
  2+ threads, which torch's alerts do not mention);
- `detrace.ops`: the ops `detrace.deterministic(kernels="detrace")` routes to detrace's own kernels.

Every op on the list in torch.use_deterministic_algorithms' documentation has an entry (its `documented`
names); those that race on the CPU too are measured here. Extend it by adding an `OpEntry` to `ENTRIES`
(docs/audit.md shows how); `tests/integration/test_audit.py` checks that every name is an ATen op of the
installed torch and that every name the installed torch's documentation lists is covered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from detrace.investigate.audit.records import Fixer

Repeats = Literal["", "index-list", "flat", "along-dim", "planes"]
"""How the indices an op writes through are read: `index-list` (index_put's list of index tensors, one per
indexed dimension), `flat` (one index tensor, every entry a destination), `along-dim` (scatter's index, whose
entries are destinations along `dim` within each line), `planes` (max_unpool's indices: destinations within
each (batch, channel) plane); "" for ops that race whatever their inputs."""

Condition = Literal["", "floating", "weights", "quantized", "sparse", "with-indices", "mode-max", "src-tensor"]
"""What else the call must have for its kernel to race, as torch documents it: a floating or complex `self`
(cumsum), `weights` given (bincount), a quantized `self` (resize_), a sparse argument (bmm), an indices output
(median over a dim), `mode` max (embedding_bag), a tensor `src` (scatter); "" for none."""


@dataclass(frozen=True, kw_only=True)
class OpEntry:
    """One op whose result may depend on scheduling."""

    op: str
    """The ATen op without overload ("index_put_"): every overload of it is judged."""
    devices: tuple[str, ...]
    """Device types whose kernel races ("cpu": with 2+ threads; "cuda": always, atomics)."""
    indices: str = ""
    """The schema argument holding the indices it writes through; "" when it races whatever they are."""
    repeats: Repeats = ""
    """How `indices` is read (see `Repeats`)."""
    spatial: int = 0
    """For `planes`: how many trailing dimensions of the indices make one plane."""
    condition: Condition = ""
    """A further condition of torch's documentation (see `Condition`)."""
    raises_without: str = ""
    """A boolean schema argument without which torch has no deterministic kernel for the op (it raises under
    use_deterministic_algorithms, so only a code change removes it: put_'s `accumulate`); "" for none."""
    fixed_by: Fixer = "deterministic"
    """What removes it: torch.use_deterministic_algorithms (`deterministic`), also detrace's kernel routes
    (`kernels`, on the devices of detrace.ops.routing.ROUTES), or only a code change (`code`: torch has no
    deterministic kernel and raises under use_deterministic_algorithms)."""
    source: str
    """Where we know it from: torch-alert, replay, detrace.ops (comma-separated)."""
    documented: tuple[str, ...] = ()
    """The names torch.use_deterministic_algorithms' documentation lists that this op implements (a module, a
    function, or the backward of one); tests/integration/test_audit.py checks every listed name is covered."""
    why: str
    """What races, in one clause."""

    def __post_init__(self) -> None:
        if not self.op or not self.devices or not self.source or not self.why:
            raise ValueError(f"catalog entry {self.op!r} needs an op, devices, a source and a why")
        if bool(self.indices) != bool(self.repeats):
            raise ValueError(f"catalog entry {self.op!r}: `indices` and `repeats` go together")
        if (self.repeats == "planes") != (self.spatial > 0):
            raise ValueError(f"catalog entry {self.op!r}: `planes` needs `spatial`, and only it")


_WRITE = ("writes or adds values, from several threads (CPU) or with atomics (CUDA), into destinations that "
          "indices share, in an order that changes from run to run")
_SCATTER = "adds values with atomic adds into destinations that indices share"
_BACKWARD = "accumulates gradients with atomic adds into overlapping input positions"
_PICK = "returns the index of one of several equal values, whichever thread wins"
_CONV = ("runs the convolution with an algorithm cuDNN picks per shape, some of which add with atomics (benchmark "
         "mode picks by timing)")
_GETITEM = "torch.Tensor.__getitem__"  # its backward with a list of index tensors is index_put(accumulate=True)


def _entries(ops: tuple[str, ...], **fields: Any) -> tuple[OpEntry, ...]:
    return tuple(OpEntry(op=op, **fields) for op in ops)


ENTRIES: Final[tuple[OpEntry, ...]] = (
    # Index writes that race on the CPU too (measured: 2 threads give other bits from run to run).
    *_entries(("index_put_", "index_put", "_index_put_impl_"), devices=("cpu", "cuda"), indices="indices",
              repeats="index-list", source="torch-alert,replay,detrace.ops", why=_WRITE,
              documented=("torch.Tensor.index_put", _GETITEM)),
    *_entries(("put_", "put"), devices=("cpu", "cuda"), indices="index", repeats="flat", raises_without="accumulate",
              source="torch-alert,replay", why=_WRITE, documented=("torch.Tensor.put_",)),
    *_entries(("index_copy_", "index_copy"), devices=("cpu", "cuda"), indices="index", repeats="flat",
              source="torch-alert,replay", why=_WRITE, documented=("torch.Tensor.index_copy",)),
    *_entries(("max_unpool2d",), devices=("cpu", "cuda"), indices="indices", repeats="planes", spatial=2,
              fixed_by="code", source="torch-alert,replay", why=_WRITE,
              documented=("torch.nn.MaxUnpool1d", "torch.nn.MaxUnpool2d")),
    *_entries(("max_unpool3d",), devices=("cpu", "cuda"), indices="indices", repeats="planes", spatial=3,
              fixed_by="code", source="torch-alert,replay", why=_WRITE, documented=("torch.nn.MaxUnpool3d",)),
    # CUDA atomics through indices: a hazard only when an index repeats.
    *_entries(("index_add_", "index_add"), devices=("cuda",), indices="index", repeats="flat", fixed_by="kernels",
              source="torch-alert,detrace.ops", why=_SCATTER,
              documented=("torch.index_add", "torch.index_select", "torch.repeat_interleave")),
    *_entries(("scatter_add_", "scatter_add"), devices=("cuda",), indices="index", repeats="along-dim",
              fixed_by="kernels", source="torch-alert,detrace.ops", why=_SCATTER,
              documented=("torch.Tensor.scatter_add_", "torch.gather")),
    *_entries(("scatter_", "scatter"), devices=("cuda",), indices="index", repeats="along-dim",
              condition="src-tensor", source="torch-alert", why=_WRITE, documented=("torch.Tensor.scatter",)),
    *_entries(("scatter_reduce_", "scatter_reduce"), devices=("cuda",), indices="index", repeats="along-dim",
              source="torch-alert", why=_SCATTER, documented=("torch.Tensor.scatter_reduce",)),
    *_entries(("index_reduce_", "index_reduce"), devices=("cuda",), indices="index", repeats="flat",
              source="torch-alert", why=_SCATTER),
    # The CPU dispatches the first; the second is what it calls on CUDA.
    *_entries(("_embedding_bag_backward", "_embedding_bag_dense_backward"), devices=("cuda",), indices="indices",
              repeats="flat", condition="mode-max", fixed_by="code", source="torch-alert",
              documented=("torch.nn.EmbeddingBag",), why="adds the gradients of repeated bag entries with atomic adds"),
    # CUDA kernels that race whatever their inputs (atomics, or an algorithm chosen at run time).
    *_entries(("convolution", "convolution_backward"), devices=("cuda",), source="torch-alert", why=_CONV,
              documented=tuple(f"torch.nn.Conv{t}{d}d" for t in ("", "Transpose") for d in (1, 2, 3))),
    OpEntry(op="bmm", devices=("cuda",), condition="sparse", source="torch-alert", documented=("torch.bmm",),
            why="multiplies a sparse by a dense matrix adding with atomics"),
    *_entries(("upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
               "upsample_trilinear3d_backward"), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.functional.interpolate",)),
    *_entries(("_adaptive_avg_pool2d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.AdaptiveAvgPool2d",)),
    *_entries(("_adaptive_avg_pool3d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.AdaptiveAvgPool3d",)),
    *_entries(("adaptive_max_pool2d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.AdaptiveMaxPool2d",)),
    *_entries(("avg_pool3d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert", why=_BACKWARD,
              documented=("torch.nn.AvgPool3d",)),
    *_entries(("max_pool3d_with_indices_backward",), devices=("cuda",), source="torch-alert", why=_BACKWARD,
              documented=("torch.nn.MaxPool3d",)),
    *_entries(("fractional_max_pool2d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.FractionalMaxPool2d",)),
    *_entries(("fractional_max_pool3d_backward",), devices=("cuda",), fixed_by="code", source="torch-alert",
              why=_BACKWARD, documented=("torch.nn.FractionalMaxPool3d",)),
    *_entries(("reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward"),
              devices=("cuda",), fixed_by="code", source="torch-alert", why=_BACKWARD,
              documented=tuple(f"torch.nn.ReflectionPad{d}d" for d in (1, 2, 3))),
    *_entries(("replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward"),
              devices=("cuda",), source="torch-alert", why=_BACKWARD,
              documented=tuple(f"torch.nn.ReplicationPad{d}d" for d in (1, 2, 3))),
    *_entries(("grid_sampler_2d_backward", "grid_sampler_3d_backward"), devices=("cuda",), fixed_by="code",
              source="torch-alert", why=_BACKWARD, documented=("torch.nn.functional.grid_sample",)),
    OpEntry(op="_ctc_loss_backward", devices=("cuda",), fixed_by="code", source="torch-alert", why=_BACKWARD,
            documented=("torch.nn.CTCLoss",)),
    OpEntry(op="nll_loss2d_forward", devices=("cuda",), fixed_by="code", source="torch-alert",
            why="sums the per-pixel losses with atomic adds", documented=("torch.nn.NLLLoss",)),
    OpEntry(op="histc", devices=("cuda",), fixed_by="code", source="torch-alert",
            why="counts into bins with atomic adds", documented=("torch.histc",)),
    OpEntry(op="bincount", devices=("cuda",), condition="weights", fixed_by="code", source="torch-alert",
            why="adds weights into bins with atomic adds", documented=("torch.bincount",)),
    OpEntry(op="cumsum", devices=("cuda",), condition="floating", fixed_by="code", source="torch-alert",
            why="sums a floating-point scan in an order set by the launch", documented=("torch.cumsum",)),
    OpEntry(op="median", devices=("cuda",), condition="with-indices", fixed_by="code", source="torch-alert",
            why=_PICK, documented=("torch.median",)),
    OpEntry(op="resize_", devices=("cpu", "cuda"), condition="quantized", fixed_by="code", source="torch-alert",
            why="leaves a quantized tensor's new memory uninitialized", documented=("torch.Tensor.resize_",)),
    OpEntry(op="kthvalue", devices=("cuda",), source="torch-alert (torch 1.x)", why=_PICK),
)

BY_OP: Final[dict[str, OpEntry]] = {entry.op: entry for entry in ENTRIES}
"""The catalog by op name (no overload), as the probe looks it up for every call."""
