"""Where each process of the reference workload sits: the layouts' device meshes, and starting and stopping
torch.distributed for them (from torchrun's environment; gloo on CPU, NCCL on GPU).

`detrace.workload.sharding` splits the model over the mesh that a `Layout` describes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from detrace.errors import UsageError

# layout -> its mesh as (dim name, size or None for "the rest of the world"), outermost first
LAYOUTS: dict[str, tuple[tuple[str, int | None], ...]] = {
    "none": (),
    "ddp": (("dp", None),),
    "fsdp": (("dp", None),),
    "tp": (("tp", None),),
    "ep": (("ep", None),),
    "pp": (("pp", 2),),
    "dp-ep": (("dp", None), ("ep", 2)),
    "pp-dp": (("pp", 2), ("dp", None)),
    "dp-invariant": (("dp", None),),
    "tp-invariant": (("dp", None), ("tp", None)),
    "tp-plain": (("dp", None), ("tp", None)),
    "fsdp-invariant": (("fsdp", None),),
    "fsdp-plain": (("fsdp", None),),
    "pp-invariant": (("pp", None), ("dp", None)),
    "pp-plain": (("pp", None), ("dp", None)),
    "ep-invariant": (("dp", None), ("ep", None)),
    "ep-plain": (("dp", None), ("ep", None)),
    "ep-fsdp-invariant": (("fsdp", None), ("ep", None)),
}
"""The tp layouts' sizes come from `setup(kind, tp=T)`: dp = W / T (1 included), tp = T; the ep- layouts' from
`setup(kind, dp=D, tp=T)`: dp = D (ep-fsdp-invariant: fsdp = D), ep = W / (D T), tp = T (ep-invariant only), or
`setup(kind, pp=P)` (ep-invariant, ep-plain): pp = P, ep = W / P."""

INVARIANT = ("dp-invariant", "tp-invariant", "tp-plain", "fsdp-invariant", "fsdp-plain", "pp-invariant", "pp-plain",
             "ep-invariant", "ep-plain", "ep-fsdp-invariant")
"""Layouts whose every rank reads the whole global batch and computes its block of the M microbatches, summed in the
fixed tree of `detrace.parallel.data` over the dp ranks (tp-plain: plain tensor parallelism inside, the control of
tp-invariant), or over the fsdp ranks by fully_shard's reduce-scatter (`detrace.parallel.fsdp`; fsdp-plain:
fully_shard's own reduce-scatter and gradient accumulation, the control of fsdp-invariant), or by each pipeline stage
over the microbatches of its schedule (pp-invariant, `detrace.parallel.pipeline`; pp-plain: autograd's running sum
over them, the control of pp-invariant), or over the dp x ep ranks with the experts' gradients summed per source
(ep-invariant, `detrace.parallel.expert`; ep-plain: the ordinary all-to-all MoE, the control; on a pp x ep mesh,
each stage's tree as pp-invariant's and its experts' per source, or the controls of both)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where this process sits: the mesh of the layout and its coordinates in it."""

    kind: str
    """One of `LAYOUTS`."""
    rank: int
    """Global rank (0 without torch.distributed)."""
    world: int
    """World size (1 without torch.distributed)."""
    device: torch.device
    """cuda:<local rank> when CUDA is available, else cpu."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Mesh dimension -> size, outermost first; empty for "none"."""
    coords: dict[str, int] = field(default_factory=dict)
    """Mesh dimension -> this rank's coordinate."""
    mesh: DeviceMesh | None = None
    """The device mesh (None for "none")."""

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise UsageError(f"parallel layout {self.kind!r} must be one of {', '.join(LAYOUTS)}")

    def size(self, dim: str) -> int:
        return self.sizes.get(dim, 1)

    def coord(self, dim: str) -> int:
        return self.coords.get(dim, 0)

    def group(self, dim: str) -> dist.ProcessGroup:
        assert self.mesh is not None
        return self.mesh.get_group(dim)

    @property
    def data_streams(self) -> int:
        """How many different batches one step consumes: data parallel and expert parallel ranks each read
        their own; tensor and pipeline parallel ranks share one; invariant layouts' ranks all read the global
        batch."""
        if self.kind in INVARIANT:
            return 1
        return self.size("dp") * self.size("ep")

    @property
    def data_rank(self) -> int:
        if self.kind in INVARIANT:
            return 0
        return self.coord("dp") * self.size("ep") + self.coord("ep")


def setup(kind: str, *, tp: int = 1, pp: int = 1, dp: int = 1) -> Layout:
    """Start torch.distributed for `kind` (from torchrun's environment) and build its mesh; `tp` is the
    tensor-parallel size of the tp layouts (and of pp- and fsdp-invariant), `pp` the stages of pp-invariant
    (data-parallel over the rest), of the fsdp layouts (each stage sharded over the rest) and of ep-invariant and
    ep-plain (each stage's experts split over the rest), `dp` the replicas of the fsdp layouts (each sharded over the
    rest) and of the ep layouts' experts (split over the rest; on ep-fsdp-invariant the replicas are its fsdp
    dimension)."""
    if kind not in LAYOUTS:
        raise UsageError(f"parallel layout {kind!r} must be one of {', '.join(LAYOUTS)}")
    cuda = torch.cuda.is_available()
    if kind == "none":
        return Layout(kind=kind, rank=0, world=1, device=torch.device("cuda" if cuda else "cpu"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if kind in INVARIANT and world == 1:  # one process computes all M microbatches: no group needed
        if tp != 1:
            raise UsageError(f"--tp {tp} needs {tp} processes or a multiple: launch it with torchrun")
        return Layout(kind=kind, rank=0, world=1, device=torch.device("cuda" if cuda else "cpu"))
    if kind in ("pp-invariant", "pp-plain"):
        if pp < 2 or world % (pp * tp):
            raise UsageError(f"--parallel {kind} needs 2 or more stages dividing the world size {world}")
        return _mesh(kind, world, {"pp": pp, "dp": world // (pp * tp), **({"tp": tp} if tp > 1 else {})}, cuda)
    if kind in ("fsdp-invariant", "fsdp-plain") and pp > 1:  # pp x fsdp: each stage sharded over the rest
        if tp * dp > 1 or world % pp or (world // pp) & (world // pp - 1):
            raise UsageError(f"the stages' FSDP shards must be a power of two dividing the world size {world}")
        return _mesh(kind, world, {"pp": pp, "fsdp": world // pp}, cuda)
    if kind in ("fsdp-invariant", "fsdp-plain") and tp * dp > 1:
        if tp & (tp - 1) or dp & (dp - 1) or world % (tp * dp):
            raise UsageError(f"--tp and the replicas must be powers of two dividing the world size {world}")
        return _mesh(kind, world, {**({"dp": dp} if dp > 1 else {}), "fsdp": world // (tp * dp),
                                   **({"tp": tp} if tp > 1 else {})}, cuda)
    if kind in ("ep-invariant", "ep-plain") and pp > 1:  # pp x ep: each stage's experts split over the rest
        if tp * dp > 1 or world % pp or (world // pp) & (world // pp - 1):
            raise UsageError(f"the stages' expert-parallel ranks must be a power of two dividing the world size "
                             f"{world}")
        return _mesh(kind, world, {"pp": pp, "ep": world // pp}, cuda)
    if kind in ("ep-invariant", "ep-plain", "ep-fsdp-invariant"):
        if tp > 1 and kind != "ep-invariant":
            raise UsageError(f"--parallel {kind} has no tensor-parallel dimension")
        ep = world // (dp * tp)
        if dp < 1 or world % (dp * tp) or ep & (ep - 1):
            raise UsageError(f"the expert-parallel size must be a power of two dividing the world size {world}")
        return _mesh(kind, world, {("fsdp" if kind == "ep-fsdp-invariant" else "dp"): dp, "ep": ep,
                                   **({"tp": tp} if tp > 1 else {})}, cuda)
    if kind in ("tp-invariant", "tp-plain"):
        if tp < 1 or tp & (tp - 1) or world % tp:
            raise UsageError(f"--tp must be a power of two dividing the world size {world}, not {tp}")
        return _mesh(kind, world, {"dp": world // tp, "tp": tp}, cuda)
    if world < 2 or "MASTER_ADDR" not in os.environ:
        raise UsageError(f"--parallel {kind} needs 2 or more processes: launch it with torchrun --nproc-per-node N")
    fixed = math.prod(size for _, size in LAYOUTS[kind] if size is not None)
    if world % fixed or world // fixed < 1 or (None in dict(LAYOUTS[kind]).values() and world == fixed):
        raise UsageError(f"--parallel {kind} needs a world size that is a multiple of {2 * fixed}, not {world}")
    return _mesh(kind, world, {name: size if size is not None else world // fixed for name, size in LAYOUTS[kind]},
                 cuda)


def _mesh(kind: str, world: int, sizes: dict[str, int], cuda: bool) -> Layout:
    """Join the process group and build the mesh of `sizes` (outermost first)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    coords = {name: mesh.get_local_rank(name) for name in sizes}
    return Layout(kind=kind, rank=dist.get_rank(), world=world, device=device, sizes=sizes, coords=coords, mesh=mesh)


def teardown(layout: Layout, *, completed: bool) -> None:
    if layout.mesh is not None and dist.is_initialized():
        if completed:
            dist.barrier()  # no rank tears its groups down while a peer still waits on its last collective
        dist.destroy_process_group()
