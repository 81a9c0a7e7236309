"""Judging what a run holds: its eager op calls against the catalog, and its settings, collectives, parallel
wrappers and data loaders (live objects, looked at once the audited steps are over).

Each function is pure over what it is given, so tests judge synthetic calls and objects in process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from detrace.investigate.audit.catalog import OpEntry
from detrace.investigate.audit.records import Certainty, Fixer, Hazard
from detrace.recipe import Finding
from detrace.state.sample_keys import SampleKeys


def repeated(indices: Any, how: str, dim: int = 0, spatial: int = 0) -> tuple[int, int]:
    """(how many index entries hit a destination an earlier entry already hit, how many entries there are).

    `how` is a `catalog.Repeats`: index-list (index_put's list, None for a dimension taken whole; a boolean
    mask selects each position once), flat, along-dim (scatter: destinations are (line, index) pairs) or planes
    (max_unpool: (plane, index) pairs, a plane being the last `spatial` dimensions)."""
    with torch.no_grad():
        if how == "index-list":
            longs = [t for t in indices if isinstance(t, torch.Tensor) and t.dtype != torch.bool]
            if not longs:
                return 0, 0
            rows = torch.stack(torch.broadcast_tensors(*longs), dim=-1).reshape(-1, len(longs))
            return rows.shape[0] - torch.unique(rows, dim=0).shape[0], rows.shape[0]
        if how == "flat":
            flat = indices.reshape(-1)
            return flat.numel() - torch.unique(flat).numel(), flat.numel()
        if how in ("along-dim", "planes"):
            if indices.numel() == 0:
                return 0, 0
            if how == "planes":
                lines = indices.reshape(-1, math.prod(indices.shape[-spatial:]))
            else:
                lines = indices.movedim(dim, -1).reshape(-1, indices.shape[dim] if indices.dim() else 1)
            line_ids = torch.arange(lines.shape[0], device=lines.device).unsqueeze(1).expand_as(lines)
            pairs = torch.stack([line_ids, lines], dim=-1).reshape(-1, 2)
            return pairs.shape[0] - torch.unique(pairs, dim=0).shape[0], pairs.shape[0]
    raise ValueError(f"unknown way of reading indices: {how!r}")


def _tensors(arguments: Mapping[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in arguments.values():
        values = value if isinstance(value, list | tuple) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


def _holds(condition: str, arguments: Mapping[str, Any]) -> bool:
    """Whether a call meets a `catalog.Condition`."""
    this = arguments.get("self")
    if condition == "floating":
        dtype = arguments.get("dtype") or getattr(this, "dtype", None)
        return dtype is not None and (dtype.is_floating_point or dtype.is_complex)
    if condition == "weights":
        return arguments.get("weights") is not None
    if condition == "quantized":
        return isinstance(this, torch.Tensor) and this.is_quantized
    if condition == "sparse":
        return any(t.layout != torch.strided for t in _tensors(arguments))
    if condition == "with-indices":
        return "dim" in arguments
    if condition == "mode-max":
        return arguments.get("mode") == 2  # EmbeddingBag's modes: 0 sum, 1 mean, 2 max
    if condition == "src-tensor":
        return isinstance(arguments.get("src"), torch.Tensor)
    return True


def judge_op(entry: OpEntry, *, device: str, arguments: Mapping[str, Any], deterministic: bool,
             threads: int) -> tuple[Certainty, str, Fixer] | None:
    """Whether one call of a catalogued op is a hazard, how sure, why, and what removes it (None: not a hazard).

    `arguments`: the call's arguments by schema name. Not a hazard: under torch.use_deterministic_algorithms
    (torch then runs a deterministic kernel or raises), when the call does not meet the entry's condition, or
    when no index repeats. Certain on a device whose kernel races (the CPU: at 2+ threads); possible on the CPU
    at one thread, and on a device whose kernel does not race when another device's does (a CUDA-only race seen
    in a CPU run: it strikes when the same code runs on a GPU)."""
    if deterministic or not _holds(entry.condition, arguments):
        return None
    why = entry.why
    if entry.indices:
        repeats, total = repeated(arguments.get(entry.indices), entry.repeats, int(arguments.get("dim") or 0),
                                  entry.spatial)
        if repeats == 0:
            return None
        why = f"{why}: {repeats} of its {total} indices repeat an earlier one"
    fixer: Fixer = entry.fixed_by
    if fixer == "kernels" and device != "cuda" and device in entry.devices:
        fixer = "deterministic"  # it races here, and detrace.ops routes these ops on CUDA only
    if entry.raises_without and not arguments.get(entry.raises_without):
        fixer = "code"
    if device not in entry.devices:
        others = " and ".join(d.upper() for d in entry.devices)
        return "possible", f"on {others} it {why} (this {device.upper()} run's kernel does not race)", fixer
    if device == "cpu" and threads < 2:
        return "possible", f"{why}; it races at 2+ threads, and this run used 1", fixer
    return "certain", why if device != "cpu" else f"{why}, at {threads} threads", fixer


def settings_hazards(findings: Iterable[Finding]) -> list[Hazard]:
    """`detrace doctor`'s findings that are not ok, as possible hazards: a switch of the recipe (pending, in
    conflict, too late) is fixed by detrace.deterministic(); a risk the recipe cannot remove needs a change."""
    hazards = []
    for finding in findings:
        if finding.status == "ok":
            continue
        fixer: Fixer = "code" if finding.status == "risk" else "deterministic"
        hazards.append(Hazard(kind="setting", certainty="possible", subject=f"{finding.name} = {finding.value}",
                              what=f"{finding.status}: {finding.detail}",
                              fix=("detrace.deterministic(seed) sets it" if fixer == "deterministic"
                                   else "as the finding says (why)"),
                              fixed_by=fixer, source="detrace doctor"))
    return hazards


_NCCL = (
    ("NCCL_PROTO", lambda v: v in ("", "Simple"),
     "NCCL picks the protocol (LL, LL128, Simple) by message size and topology, and with it how a reduction is "
     "split into chunks", "set NCCL_PROTO=Simple where the run is launched"),
    ("NCCL_NVLS_ENABLE", lambda v: v == "0",
     "NVLink SHARP (NVLS) reduces in the NVSwitch, in an order of its own, where the machine has one",
     "set NCCL_NVLS_ENABLE=0 where the run is launched"),
    ("NCCL_COLLNET_ENABLE", lambda v: v in ("", "0"),
     "CollNet reduces in the network switches, in an order of its own", "unset NCCL_COLLNET_ENABLE"),
)


def communication_hazards(environ: Mapping[str, str], backend: str | None, world_size: int,
                          rank: int | None) -> list[Hazard]:
    """NCCL settings that let a collective's reduction order change between allocations (NCCL_ALGO is a switch
    of the recipe, judged with the settings), for a run whose default process group uses NCCL."""
    if backend != "nccl" or world_size < 2:
        return []
    ranks = (rank,) if rank is not None else ()
    return [Hazard(kind="communication", certainty="possible", subject=f"{name} = {environ.get(name, '<unset>')}",
                   what=what, fix=fix, fixed_by="code", ranks=ranks, source="NCCL documentation")
            for name, fine, what, fix in _NCCL if not fine(environ.get(name, ""))]


def parallel_hazards(ddp_modules: Sequence[Any], world_size: int, rank: int | None,
                     pinned: Callable[[Any], bool] = lambda ddp: False) -> list[Hazard]:
    """DistributedDataParallel wrappers: the bucket layout rebuilt after the first step (a resumed run all-reduces
    other buckets in its first step: possible, as it strikes on a resume, not in two runs from the start) unless
    `pinned` says detrace pinned it (TrainState,
    `detrace.integrations.accelerate.register`, the Lightning callback), and the gradient all-reduce whose
    reduction order depends on the world size (possible: another world size gives other bits)."""
    hazards = []
    ranks = (rank,) if rank is not None else ()
    for i, ddp in enumerate(ddp_modules):
        subject = f"DistributedDataParallel #{i} ({type(ddp.module).__name__})"
        if not getattr(ddp, "find_unused_parameters", False) and not getattr(ddp, "static_graph", False) \
                and not pinned(ddp):
            hazards.append(Hazard(
                kind="parallel", certainty="possible", subject=subject, ranks=ranks,
                what=("DDP rebuilds its gradient buckets after the first step, in the order the gradients became "
                      "ready; a run resumed from a checkpoint starts with the initial layout and all-reduces other "
                      "buffers in its first step, so its bits differ from the run that never stopped"),
                fix=("build a detrace.TrainState for the model before the first step (or use the accelerate or "
                     "Lightning integration): it pins one layout in every process; or pass "
                     "find_unused_parameters=True (docs/resume.md); `detrace check-resume` checks"),
                fixed_by="code", source="torch DDP Reducer"))
        if world_size > 1:
            hazards.append(Hazard(
                kind="parallel", certainty="possible", subject=subject, ranks=ranks,
                what=(f"the gradient all-reduce sums {world_size} ranks' gradients in an order set by the world "
                      "size (ring chunks, tree shape): the same global batch on another number of ranks gives "
                      "other bits"),
                fix=("wrap the model in detrace.parallel.data.InvariantDataParallel (microbatch sums in a fixed order "
                     "whatever the world size); `detrace check-topology` checks"), fixed_by="code",
                source="detrace check-topology"))
    return hazards


def data_hazards(loaders: Sequence[Any], collate_draws: Iterable[str], *, torch_unseeded: bool = False,
                 workers_draw: bool = False) -> list[Hazard]:
    """DataLoaders: workers with no generator, a sampler without state, an IterableDataset without state_dict;
    and the collate functions seen drawing random numbers (`collate_draws`).

    Workers seed torch, random and numpy from a base seed each iterator draws from the loader's generator (the
    main process's global one without it). Certain when that generator was never seeded and the workers draw
    (`workers_draw`: a fetch in a worker changed a global RNG): every run feeds other data; else possible, as a
    restarted run draws another base seed than the run that never stopped."""
    hazards = []
    for i, loader in enumerate(loaders):
        subject = f"DataLoader #{i} ({type(loader.dataset).__name__})"
        if loader.num_workers > 0 and loader.generator is None and loader.worker_init_fn is None:
            if torch_unseeded and workers_draw:
                hazards.append(Hazard(
                    kind="data", certainty="certain", subject=subject,
                    what=(f"{loader.num_workers} workers draw random numbers, seeded from a base seed drawn from "
                          "torch's global generator, which this run never seeds: every run feeds other data"),
                    fix=("pass generator=torch.Generator().manual_seed(seed), or seed torch with "
                         "detrace.deterministic(seed) before the loop"), fixed_by="code", source="torch DataLoader"))
            else:
                hazards.append(Hazard(
                    kind="data", certainty="possible", subject=subject,
                    what=(f"{loader.num_workers} workers seeded (torch, random and numpy) from a base seed drawn from "
                          "the main process's global generator, with no generator of their own: a restarted run "
                          "draws another base seed than the run that never stopped"),
                    fix="pass generator=torch.Generator().manual_seed(seed)", fixed_by="code",
                    source="torch DataLoader"))
        # The order's source: the sampler inside a BatchSampler, else a custom batch sampler itself. Resumable:
        # one with state_dict; an order fixed in advance (sequential, or the list of batches that
        # detrace.state.loader.ResumableLoader passes); one set by (seed, epoch): set_epoch (DistributedSampler), or
        # the keys detrace's framework integrations install, whose epoch and skip the integration restores.
        sampler = getattr(loader.batch_sampler, "sampler", loader.batch_sampler)
        iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        if not iterable and not isinstance(sampler, (torch.utils.data.SequentialSampler, SampleKeys, list, tuple)) \
                and not hasattr(sampler, "state_dict") and not hasattr(sampler, "set_epoch"):
            hazards.append(Hazard(
                kind="data", certainty="possible", subject=f"{subject} sampler {type(sampler).__name__}",
                what=("the sampler has no state_dict: a run resumed mid-epoch cannot continue its order, and "
                      "restarts the epoch's permutation or draws a new one"),
                fix=("use detrace.state.loader.ResumableSampler (or ResumableLoader), or give the sampler "
                     "state_dict/load_state_dict"),
                fixed_by="code", source="detrace check-resume"))
        if iterable and not hasattr(loader.dataset, "state_dict"):
            hazards.append(Hazard(
                kind="data", certainty="possible", subject=subject,
                what="an IterableDataset without state_dict: a resumed run cannot continue its stream where it stopped",
                fix="give the dataset state_dict/load_state_dict (the position in its stream and its RNG)",
                fixed_by="code", source="detrace check-resume"))
    for name in sorted(set(collate_draws)):
        hazards.append(Hazard(
            kind="data", certainty="possible", subject=f"collate_fn {name}",
            what=("collate_fn draws from a global RNG: each worker draws from its own, so the batches change with "
                  "num_workers, and a restart draws other numbers"),
            fix="draw the randomness in the dataset from a per-sample seed, or pass collate_fn a seeded generator",
            fixed_by="code", source="detrace audit"))
    return hazards
