"""`detrace check-topology`: the same bits at every layout, and across an elastic resume.

CMD runs under torchrun once per layout, traced at the semantic rung (which records every parameter after each
optimizer step, by qualified name, and the exact losses and gradient norm). A layout is a world size W (`--worlds`)
or a named layout (`--layouts`, `detrace.parallel.layout`: `fsdp2`, `2x2` for D x T; its world size in processes,
its name in DETRACE_LAYOUT and its T in DETRACE_TP in CMD's environment). Records are aligned by global identity,
not by rank: a parameter by (global step, qualified name); a loss by (global step, global microbatch index), where
the k-th loss of a step on data-parallel coordinate d is microbatch d * n + k when every rank computes n (the
contiguous blocks of `detrace.parallel.data`; d the rank's coordinate over the data dimensions,
`Layout.data_block`; a loop that scales each loss by 1/n for its rank's n microbatches, as torch's averaging does, is
compared on the losses before that scaling, see `_losses`); the gradient norm by global step, compared only when no
layout splits the gradients (T > 1, FSDP, pipeline or expert parallelism: the tracer's norm is of the rank's own
part). A sharded DTensor parameter (FSDP, `parallelize_module`) is recorded by each rank as its part of the global
fingerprint (`detrace.digest.sharded.part_of`: numel below the global shape's); the distinct shards' parts add up to
the global fingerprint, compared by name like any other (where one rank holds every element of an uneven shard and
the others' parts are empty, that rank's whole record is the global fingerprint). A plain tensor that every rank of
a sharded layout holding it records whole, with the shape an unsharded layout of the check gives its name (an expert
script's router), is a replica, compared by name like any other. Where ranks hold plain shards of
one parameter under one name (the reference trainer's expert parallelism) the tracer records each shard: that run's
parameters are then compared through the `final params` line, which it and the reference must print; the other
runs' still step by step against an unsharded reference (with a sharded reference, no run's are). A name that
several ranks of a run hold (a replica) must have the same bits on each; a chunk held by one rank
(`detrace.parallel.tensor`) is taken from it.
Every run must equal the first layout's; runs whose parameters are not the same set (names, and shapes where no
rank holds a shard) train other models, and are refused (exit 2) naming the first parameter. A `final params HEX`
line in CMD's output is compared too, in each run that prints one, when the reference does (a CMD need not print
one).

With `resume_at=K` (`--resume-at K`), the first world size's continuous run is the reference; CMD then runs at
that world size stopped after step K (the resume contract: DETRACE_CKPT_DIR, DETRACE_STOP_AT), and is resumed
from that checkpoint at each other world size (DETRACE_RESUME=1); each resumed run must equal the reference
from step K on, and the stopped run before it.

The thread count per rank is set explicitly (OMP_NUM_THREADS; torchrun would set 1 only for 2+ processes):
a CPU kernel's bits may depend on it. The function that runs CMD is a parameter (`launch`), so the comparison
and the verdict can be tested on synthetic traces.
"""

from __future__ import annotations

import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch

from detrace._numbers import parse_count
from detrace.digest.sharded import whole_digest
from detrace.errors import CommandFailed, IncomparableError, TraceError, UsageError
from detrace.launch.launcher import LaunchResult, run_traced
from detrace.parallel.layout import LAYOUT_ENV, Layout
from detrace.parallel.tensor import TP_ENV
from detrace.tracefile.layout import prepare_out
from detrace.tracefile.reader import open_run, read_rank

RUNG = "semantic"
"""The cheapest rung that records the parameters after every optimizer step."""
FINAL = re.compile(r"^final params ([0-9a-f]{16})\s*$", re.MULTILINE)
FINAL_PARAM = re.compile(r"^final param (\S+) ([0-9a-f]{16})\s*$", re.MULTILINE)
"""One parameter's final fingerprint (of the whole tensor), which a trainer on a sharded layout may print besides the
`final params` line, so that the verdict names the first parameter that differs at the end."""

Progress = Callable[[str], None]
Launch = Callable[[list[str], Path, dict[str, str], "float | None"], LaunchResult]
"""Runs argv (CMD under torchrun) traced at `RUNG` into a run directory, with variables added to the
environment, within a timeout: `run_traced` for real, a writer of synthetic traces in tests."""
Key = tuple[int, str, str]
"""(global step, kind, name): kind is "loss", "grad_norm", "param" or "final" (a parameter as the run ended, at
`FINAL_STEP`); name the microbatch or parameter."""
FINAL_STEP = sys.maxsize - 1
"""The step of the state a run ended with (the tracer's phase "final"): after every step, inside a resumed run's
window, outside a stopped run's."""


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """One layout of the check: D data-parallel by T tensor-parallel ranks (T innermost), or a named `Layout`."""

    dp: int
    """D: data-parallel ranks (the data blocks of `layout` when given)."""
    tp: int = 1
    """T: tensor-parallel ranks; 1 for `--worlds`."""
    layout: Layout | None = None
    """The named layout (`--layouts`), None for a world size."""

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise UsageError(f"a layout needs positive sizes, not {self.dp}x{self.tp}")

    @classmethod
    def of(cls, layout: Layout) -> Mesh:
        return cls(dp=layout.data, tp=layout.size("tp"), layout=layout)

    @property
    def world(self) -> int:
        return self.layout.world if self.layout is not None else self.dp * self.tp

    @property
    def label(self) -> str:
        return self.layout.name if self.layout is not None else f"{self.dp}x{self.tp}"

    def block(self, rank: int) -> int:
        """The data block (of the global batch's microbatches) that `rank` computes."""
        return self.layout.data_block(rank) if self.layout is not None else rank // self.tp

    @property
    def shards(self) -> bool:
        """Whether ranks hold shards of one parameter under one name (FSDP, expert parallelism): a sharded DTensor's
        records are its shards' parts of the global fingerprint, compared once added up; a plain replica (see
        `_records`) like any parameter; a plain shard only through the `final params` line."""
        return self.layout is not None and self.layout.size("fsdp") * self.layout.size("ep") > 1

    @property
    def local_norms(self) -> bool:
        """Whether the tracer's gradient norm is of each rank's own part of the gradients (not comparable)."""
        return self.tp > 1 or self.shards or (self.layout is not None and self.layout.size("pp") > 1)


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """The first record that differs."""

    step: int
    """Global step (0 is the first optimizer step), -1 for the final params line and the state the run ended with."""
    kind: str
    """loss, grad_norm, param, final (a parameter as the run ended), final params (the printed line), or ranks (two
    ranks of one run disagree)."""
    name: str
    """The tensor's qualified name, the loss's global microbatch, or what is missing."""
    world: int
    """The world size of the run that differs (from the reference, or within itself for kind "ranks")."""
    run: str
    """That run, as the verdict names it: "world 2", "layout 2x2", "world 4 resumed after step 2"."""
    detail: str

    def sentence(self, reference: str) -> str:
        against = f"{self.run}'s ranks disagree" if self.kind == "ranks" else f"{self.run} differs from {reference}"
        return f"{against} {self.place()}"

    def place(self) -> str:
        """Where and what: "at step 1: tensor b (HEX vs HEX)"."""
        # a disagreement between ranks names the record's kind first ("final 0.weight": a parameter as the run ended)
        end = self.kind == "final" or (self.kind == "ranks" and self.name.startswith("final "))
        where = "the end" if end else "the final params line" if self.step < 0 else f"step {self.step}"
        what = {"param": f"tensor {self.name}", "final": f"tensor {self.name}",
                "loss": f"loss of microbatch {self.name}", "grad_norm": "grad_norm", "final params": "",
                "ranks": self.name}[self.kind]
        return f"at {where}{': ' + what if what else ''} ({self.detail})"


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run of CMD in the check."""

    label: str
    """How the verdict names it ("world 2", "layout 1x2", "world 4 resumed after step 2")."""
    mesh: Mesh
    path: Path
    """Its run directory."""
    from_step: int = 0
    """The first global step it runs (K for a run resumed after step K)."""
    until_step: int | None = None
    """The step it stops after (K for the run stopped to write the checkpoint), or None: to the end."""


@dataclass(frozen=True, kw_only=True)
class RunVerdict:
    """How one run compares with the reference."""

    run: str
    """The run, as the verdict names it."""
    first: Mismatch | None
    """Its first record that differs from the reference's (or its own ranks' disagreement); None: the same bits."""
    first_param: Mismatch | None = None
    """Its first parameter that differs, when `first` is a loss, a norm or the final params line."""


def _json(m: Mismatch | None) -> dict[str, Any] | None:
    return None if m is None else {"step": m.step, "kind": m.kind, "name": m.name, "world": m.world, "run": m.run,
                                   "detail": m.detail}


@dataclass(frozen=True, kw_only=True)
class TopologyResult:
    """The outcome of `detrace check-topology`."""

    runs: tuple[Run, ...]
    """The reference first."""
    steps: int
    """Global steps compared."""
    tensors: int
    """Parameters compared per step."""
    finals: dict[str, str | None]
    """Each run's `final params` line by label (None when it printed none)."""
    first: Mismatch | None
    first_param: Mismatch | None = None
    """The first parameter that differs (in the first run that differs), when `first` is a loss or norm."""
    resume_at: int | None = None
    verdicts: tuple[RunVerdict, ...] = ()
    """Each run but the reference, in the order they ran: its own first mismatch or none (`first` is the first
    run's that differs), so that one check can hold several layouts that differ."""
    partial: tuple[str, ...] = ()
    """The runs whose parameters were compared only in part after each step: ranks held plain shards of them (the
    reference trainer's experts), compared through the final params line."""

    @property
    def identical(self) -> bool:
        return self.first is None

    @property
    def reference(self) -> str:
        return self.runs[0].label

    def to_json(self) -> dict[str, Any]:
        first, param = _json(self.first), _json(self.first_param)
        return {"schema": "detrace.check-topology/2", "identical": self.identical,
                "worlds": sorted({r.mesh.world for r in self.runs}), "layouts": [r.mesh.label for r in self.runs],
                "resume_at": self.resume_at, "runs": {r.label: str(r.path) for r in self.runs}, "steps": self.steps,
                "tensors": self.tensors, "final_params": dict(self.finals), "first": first,
                "first_param": param,
                "by_run": {v.run: {"identical": v.first is None, "first": _json(v.first),
                                   "first_param": _json(v.first_param)} for v in self.verdicts}}


def max_world() -> int:
    """The most processes this machine runs at once for check-topology: 4 per CPU core (gloo ranks on CPU; more
    only thrash, and a typo such as 64 would start 64 trainings)."""
    return 4 * (os.cpu_count() or 1)


def check_processes(processes: int, *, option: str, force: bool) -> None:
    """The one bound on what a layout may start, whatever spells it (`--worlds`, `--layouts`): `processes` (a
    layout's world size) above `max_world()` is refused unless `force`. `option` names what the user gave."""
    if processes > max_world() and not force:
        raise UsageError(f"{option} would start {processes} processes, more than this machine's {os.cpu_count()} "
                         f"CPU cores run well (at most {max_world()}); pass --force to start them")


def parse_worlds(text: str, *, force: bool = False) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4): at least two distinct positive world sizes, none above `max_world()` unless `force`."""
    worlds = tuple(parse_count(part) for part in text.split(","))
    if any(world is None for world in worlds):
        raise UsageError(f"--worlds must be comma-separated world sizes such as 1,2,4, not {text!r}")
    sizes = tuple(world for world in worlds if world is not None)
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise UsageError(f"--worlds needs two or more distinct positive world sizes, not {text!r}")
    check_processes(max(sizes), option=f"--worlds {text}", force=force)
    return sizes


def parse_layouts(text: str, *, force: bool = False) -> tuple[Mesh, ...]:
    """`fsdp1,fsdp2,fsdp4` or `1x1,1x2,2x2` (see `detrace.parallel.layout`) -> the meshes: two or more distinct
    ones, none of more than `max_world()` processes unless `force`."""
    parts = [part.strip() for part in text.split(",")]
    layouts = tuple(Layout.parse(part) for part in parts)
    if len(layouts) < 2:
        raise UsageError(f"--layouts needs two or more distinct layouts, not {text!r}")
    first: dict[tuple[tuple[str, int], ...], int] = {}
    for index, layout in enumerate(layouts):  # one layout under two names (fsdp01 and fsdp1, 2x2 and dp2xtp2)
        if (other := first.setdefault(layout.sizes, index)) != index:
            raise UsageError(f"--layouts names one layout twice: {parts[other]!r} and {parts[index]!r} are the same "
                             f"layout")
    meshes = tuple(Mesh.of(layout) for layout in layouts)
    check_processes(max(m.world for m in meshes), option=f"--layouts {text}", force=force)
    return meshes


def torchrun_command(cmd: list[str], world: int) -> list[str]:
    """CMD started by torchrun on `world` processes of this machine (CMD itself, unchanged, in each)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "--no-python", *cmd]


def launch_traced(argv: list[str], run: Path, env: dict[str, str], timeout: float | None) -> LaunchResult:
    """The real `Launch`: argv traced at `RUNG`, its output kept quiet (its tail is in the result)."""
    return run_traced(argv, run, rung=RUNG, timeout=timeout, quiet=True, env=env)


def _bits(value: float) -> str:
    return "0x" + struct.pack(">d", value).hex()


def _shown(kind: str, bits: str) -> str:
    """A record's value as a mismatch shows it: a loss or gradient norm as its decimal (the shortest that reads back
    as the same double) beside its bits, so the size of the difference shows; a digest as it is."""
    if kind not in ("loss", "scaled", "grad_norm") or not bits.startswith("0x"):
        return bits
    return f"{struct.unpack('>d', bytes.fromhex(bits[2:]))[0]!r} ({bits})"


Shapes = dict[str, "tuple[int, ...] | None"]
"""A run's parameters: qualified name -> shape (None where ranks hold shards of it under its name)."""


def _agreed(held: dict[int, int], key: Key, mesh: Mesh, label: str) -> tuple[str, Mismatch | None]:
    """The bits the ranks that hold one whole tensor recorded for it (replicas: each must have the same), or their
    first disagreement."""
    step, kind, name = key
    (first, value), *others = sorted(held.items())
    rank, other = next(((rank, digest) for rank, digest in others if digest != value), (first, value))
    if other == value:
        return f"{value:016x}", None
    return "", Mismatch(step=-1 if step == FINAL_STEP else step, kind="ranks", name=f"{kind} {name}",
                        world=mesh.world, run=label, detail=f"rank {first} {value:016x}, rank {rank} {other:016x}")


def _records(run: Path, mesh: Mesh, *, grad_norm: bool, label: str, replicas: Shapes | None = None
             ) -> tuple[dict[Key, str], Mismatch | None, Shapes]:
    """One run's records keyed by global identity (values as exact hex), the first disagreement between its ranks,
    and its parameters (the names its ranks hold together). `replicas`: the shapes an unsharded run of the check
    gives its parameters (None: the check has no unsharded run); on a sharded layout, a plain tensor every rank
    holding it records with that shape is a replica."""
    info = open_run(run)
    if len(info.ranks) != mesh.world:
        raise TraceError(f"{run} holds traces of ranks {list(info.ranks)}, not of all {mesh.world} ranks")
    merged: dict[Key, str] = {}
    owner: dict[Key, int] = {}
    shapes: Shapes = {}
    parts: dict[tuple[int, str, str], tuple[dict[int, int], str, tuple[int, ...]]] = {}
    """(step, kind, name) -> ({part digest: numel}, dtype, global shape) of a sharded DTensor's distinct shards."""
    wholes: dict[Key, dict[int, tuple[int, tuple[int, ...]]]] = {}
    """(step, kind, name) -> {rank: (digest, shape)} of the whole tensors ranks of a sharded layout recorded."""
    for rank in info.ranks:
        table = read_rank(run, rank).table
        params = table.filter(pc.and_(pc.equal(table["phase"], "optimizer"), pc.equal(table["role"], "param")))
        rows = params.select(["step", "name", "digest", "numel", "shape", "dtype"]).to_pylist()
        # the state the run ended with (the tracer's phase "final"): after every step, by name, as the parameters
        ended = table.filter(pc.and_(pc.equal(table["phase"], "final"), pc.equal(table["role"], "param")))
        finals = [{**row, "step": FINAL_STEP} for row in
                  ended.select(["name", "digest", "numel", "shape", "dtype"]).to_pylist()]
        for row in rows:
            part = row["numel"] != math.prod(row["shape"])  # a shard's part of its global fingerprint
            shapes.setdefault(row["name"], None if mesh.shards and not part else tuple(row["shape"]))
        metrics = table.filter(pc.equal(table["role"], "metric"))
        keyed: dict[Key, str] = {}
        losses: dict[int, list[float]] = {}
        for row in metrics.select(["step", "name", "value"]).to_pylist():
            if row["name"] == "loss":
                losses.setdefault(row["step"], []).append(row["value"])
            elif row["name"] == "grad_norm" and grad_norm:
                keyed[(row["step"], "grad_norm", "")] = _bits(row["value"])
        block = mesh.block(rank)  # the data-parallel coordinate: tp ranks of one block share its microbatches
        for step, values in losses.items():  # data-parallel rank d computes the block [d n, (d + 1) n)
            for k, loss in enumerate(values):
                keyed[(step, "loss", str(block * len(values) + k))] = _bits(loss)
                # the loss before a loop scaled it by 1/n (torch's averaging over the rank's n microbatches)
                keyed[(step, "scaled", str(block * len(values) + k))] = _bits(loss * len(values))
        for kind, row in [("param", row) for row in rows] + [("final", row) for row in finals]:
            digest = row["digest"]
            if row["numel"] != math.prod(row["shape"]) and digest is not None:
                found = parts.setdefault((row["step"], kind, row["name"]), ({}, row["dtype"], tuple(row["shape"])))[0]
                found[digest] = row["numel"]  # a replica of a shard gives the same part: counted once
            elif not mesh.shards:  # each rank's own shard of a parameter under its name: not comparable
                keyed[(row["step"], kind, row["name"])] = "none" if digest is None else f"{digest:016x}"
            elif digest is not None:
                wholes.setdefault((row["step"], kind, row["name"]), {})[rank] = (digest, tuple(row["shape"]))
        for key, bits in keyed.items():
            if key not in merged:
                merged[key], owner[key] = bits, rank
            elif merged[key] != bits:  # replicas (or one block's tp ranks) must agree
                return merged, Mismatch(step=-1 if key[0] == FINAL_STEP else key[0], kind="ranks",
                                        name=f"{key[1]} {key[2]}".strip(),
                                        world=mesh.world, run=label,
                                        detail=f"rank {owner[key]} {_shown(key[1], merged[key])}, rank {rank} "
                                               f"{_shown(key[1], bits)}"), shapes
    for key, recorded in sorted(wholes.items()):
        # a plain tensor (the router and dense layers of an expert-parallel model) that every rank holding it records
        # with its unsharded shape is a replica, compared like a 1x1 parameter; one recorded with another shape is
        # the rank's own shard (the reference trainer's experts), compared only through the final params line
        shape = (replicas or {}).get(key[2])
        if key not in parts and shape is not None and all(at == shape for _, at in recorded.values()):
            merged[key], disagreement = _agreed({rank: digest for rank, (digest, _) in recorded.items()}, key, mesh,
                                                label)
            if disagreement is not None:
                return merged, disagreement, shapes
            shapes[key[2]] = shape
    for (step, kind, name), (found, dtype, shape) in sorted(parts.items()):
        held = {rank: digest for rank, (digest, at) in wholes.get((step, kind, name), {}).items() if at == shape}
        if not sum(found.values()) and held:
            # an uneven shard whose other ranks hold nothing (a [1, n] weight over 2 ranks): the rank that holds
            # every element records the whole tensor, whose fingerprint is the global one; its replicas must agree
            merged[(step, kind, name)], disagreement = _agreed(held, (step, kind, name), mesh, label)
            if disagreement is not None:
                return merged, disagreement, shapes
            continue
        if sum(found.values()) != math.prod(shape):  # replicas of a shard that disagree, or a shard missing
            return merged, Mismatch(step=-1 if step == FINAL_STEP else step, kind="ranks", name=f"{kind} {name}",
                                    world=mesh.world, run=label,
                                    detail=f"its ranks' distinct shards hold {sum(found.values())} of its "
                                           f"{math.prod(shape)} elements"), shapes
        digest = whole_digest(list(found), getattr(torch, dtype), shape, info.header.fingerprint)
        merged[(step, kind, name)] = f"{digest:016x}"
    return merged, None, shapes


def _same_model(reference: Run, ref: Shapes, run: Run, other: Shapes) -> None:
    """Refuse two runs whose parameters are not the same set (names, and shapes where neither run shards them):
    their bits would differ because the models do, not the layouts."""
    def shape(shapes: Shapes, name: str) -> str:
        if name not in shapes:
            return "missing"
        held = shapes[name]
        return "sharded" if held is None else f"[{', '.join(map(str, held))}]"

    for name in sorted(set(ref) | set(other)):
        a, b = ref.get(name, ()), other.get(name, ())
        if name not in ref or name not in other or (a is not None and b is not None and a != b):
            raise IncomparableError(
                f"{run.label} trains another model than {reference.label}, which cannot show whether the layout "
                f"changes the bits: parameter {name} is {shape(ref, name)} in {reference.label} and "
                f"{shape(other, name)} in {run.label}")


def _order(key: Key) -> tuple[int, int, int | str]:
    step, kind, name = key
    return step, ("loss", "grad_norm", "param", "final").index(kind), int(name) if kind == "loss" else name


def _losses(ref: dict[Key, str], other: dict[Key, str]) -> tuple[dict[Key, str], dict[Key, str]]:
    """Both runs' records with the losses as compared: the recorded backward roots, or, when a loop scales each
    microbatch's loss by 1/n for its rank's n microbatches (torch's averaging, torchtitan's gradient accumulation),
    the roots times n: the loss before scaling, the same by construction at every layout.

    The roots are the unscaled losses' when they agree; the scaled convention is taken when, at the first step whose
    roots differ, every loss agrees times n (exactly: n is a power of two). A real difference differs both ways."""
    def losses(records: dict[Key, str], kind: str) -> dict[Key, str]:
        return {(step, "loss", name): bits for (step, k, name), bits in records.items() if k == kind}

    raw_ref, raw_other = losses(ref, "loss"), losses(other, "loss")
    differ = sorted(key[0] for key in set(raw_ref) | set(raw_other) if raw_ref.get(key) != raw_other.get(key))
    use = "loss"
    if differ:
        scaled_ref, scaled_other = losses(ref, "scaled"), losses(other, "scaled")
        at = {key for key in set(scaled_ref) | set(scaled_other) if key[0] == differ[0]}
        if all(scaled_ref.get(key) == scaled_other.get(key) for key in at):
            use = "scaled"

    def compared(records: dict[Key, str]) -> dict[Key, str]:
        kept = {key: bits for key, bits in records.items() if key[1] not in ("loss", "scaled")}
        return {**kept, **losses(records, use)}

    return compared(ref), compared(other)


def _differences(ref: dict[Key, str], other: dict[Key, str], run: Run) -> Iterator[Mismatch]:
    """Every record that differs, in order (step, then losses, gradient norm, parameters by name)."""
    for key in sorted(set(ref) | set(other), key=_order):
        a, b = ref.get(key, "missing"), other.get(key, "missing")
        if a != b:
            step, kind, name = key
            yield Mismatch(step=-1 if step == FINAL_STEP else step, kind=kind, name=name, world=run.mesh.world,
                           run=run.label, detail=f"{_shown(kind, a)} vs {_shown(kind, b)}")


def _check_command(cmd: list[str], threads: int) -> None:
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check-topology -- python train.py")
    if Path(cmd[0]).name in ("torchrun", "mpirun", "srun") or "torch.distributed.run" in cmd[:3]:
        raise UsageError("give CMD without a launcher: check-topology starts it under torchrun itself")
    if threads < 1:
        raise UsageError(f"--threads must be positive, not {threads}")


def plan_runs(meshes: tuple[Mesh, ...], out: Path, *, resume_at: int | None = None, tp_env: bool = False
              ) -> list[tuple[Run, dict[str, str]]]:
    """The runs of the check, the reference first, each with the variables it adds to CMD's environment.

    `tp_env` (`--layouts`) names runs by layout and sets DETRACE_LAYOUT and DETRACE_TP; else by world size. With
    `resume_at` K: the first layout continuous, then stopped after K, then resumed on each other (CMD refuses a
    checkpoint it cannot resume on another mesh)."""
    def label(m: Mesh) -> str:
        return f"layout {m.label}" if tp_env else f"world {m.world}"

    def directory(m: Mesh) -> str:
        return f"layout-{m.label}" if tp_env else f"world-{m.world}"

    def env(m: Mesh) -> dict[str, str]:
        return {TP_ENV: str(m.tp), LAYOUT_ENV: m.label} if tp_env else {}

    if resume_at is None:
        return [(Run(label=label(m), mesh=m, path=out / directory(m)), env(m)) for m in meshes]
    if resume_at < 1:
        raise UsageError(f"--resume-at must be a step of 1 or more, not {resume_at}")
    first, ckpt = meshes[0], out / "checkpoint"
    plan = [(Run(label=label(first), mesh=first, path=out / directory(first)), env(first)),
            (Run(label=f"{label(first)} stopped after step {resume_at}", mesh=first, until_step=resume_at,
                 path=out / f"{directory(first)}-stopped"),
             {**env(first), "DETRACE_CKPT_DIR": str(ckpt), "DETRACE_STOP_AT": str(resume_at)})]
    for m in meshes[1:]:
        plan.append((Run(label=f"{label(m)} resumed after step {resume_at}", mesh=m, from_step=resume_at,
                         path=out / f"{directory(m)}-resumed"),
                     {**env(m), "DETRACE_CKPT_DIR": str(ckpt), "DETRACE_RESUME": "1"}))
    return plan


def check_topology(cmd: list[str], *, meshes: tuple[Mesh, ...], out: Path, threads: int = 1,
                   timeout: float | None = None, resume_at: int | None = None, tp_env: bool = False,
                   launch: Launch = launch_traced, progress: Progress = lambda _: None) -> TopologyResult:
    """Run CMD at each layout (see `plan_runs`) and compare the runs record by record (see the module doc)."""
    _check_command(cmd, threads)
    plan = plan_runs(meshes, out, resume_at=resume_at, tp_env=tp_env)
    prepare_out(out, holds="runs")
    finals: dict[str, str | None] = {}
    by_name: dict[str, dict[str, str]] = {}
    for run, env in plan:
        progress(f"{run.label}: {run.path}")
        result = launch(torchrun_command(cmd, run.mesh.world), run.path, {"OMP_NUM_THREADS": str(threads), **env},
                        timeout)
        if result.returncode != 0:
            raise CommandFailed(f"CMD ({run.label}) exited with code {result.returncode}; its output ends "
                                f"with:\n{result.output_tail.rstrip()}")
        found = FINAL.findall(result.output_tail)
        finals[run.label] = found[-1] if found else None
        by_name[run.label] = dict(FINAL_PARAM.findall(result.output_tail))
    runs = tuple(run for run, _ in plan)
    inner, compared, steps, tensors, partial = compare(runs)
    ended = [r for r in runs if r.until_step is None]  # the stopped run's last line is not the end's
    # a sharded run whose parameters were not all recorded globally is compared through its final params line
    lined = [r for r in ended if r.mesh.shards and r.label in partial]
    sharded = next(iter(lined), None)
    if sharded is not None and not all(finals[r.label] for r in ended if r in lined or r is ended[0]):
        raise CommandFailed(f"CMD printed no `final params HEX` line in every run: on {sharded.label} each rank "
                            f"holds its own shard of parameter {partial[sharded.label]} (a plain tensor, or a "
                            "DTensor shard that splits an 8-byte word, as a float32 tensor of odd length per "
                            "rank), which is compared through that line only")
    reference = finals[ended[0].label]
    verdicts = []
    for run, (first, first_param) in zip(runs[1:], compared, strict=True):
        ends = run.until_step is None
        if first is None and ends and reference and finals[run.label] and finals[run.label] != reference:
            # every run that printed one (a pipeline stage's run may not)
            first = Mismatch(step=-1, kind="final params", name="", world=run.mesh.world, run=run.label,
                             detail=f"{reference} vs {finals[run.label]}")
        if first is not None and first.kind not in ("param", "final") and first_param is None and ends:
            first_param = _final_param(by_name[ended[0].label], by_name[run.label], run)
        verdicts.append(RunVerdict(run=run.label, first=first, first_param=first_param))
    odd = next((v for v in verdicts if v.first is not None), None)
    first, first_param = (inner, None) if inner is not None else (None, None) if odd is None else \
        (odd.first, odd.first_param)
    return TopologyResult(runs=runs, steps=steps, tensors=tensors, finals=finals, first=first,
                          first_param=first_param, resume_at=resume_at, verdicts=tuple(verdicts),
                          partial=tuple(r.label for r in runs if r.mesh.shards and r.label in partial))


def _final_param(reference: dict[str, str], other: dict[str, str], run: Run) -> Mismatch | None:
    """The first parameter (by name) whose `final param` line differs, when both runs printed them."""
    if not reference or not other:
        return None
    name = next((n for n in sorted(set(reference) | set(other)) if reference.get(n) != other.get(n)), None)
    return None if name is None else Mismatch(
        step=-1, kind="param", name=name, world=run.mesh.world, run=run.label,
        detail=f"{reference.get(name, 'missing')} vs {other.get(name, 'missing')}")


def compare(runs: tuple[Run, ...]
            ) -> tuple[Mismatch | None, list[tuple[Mismatch | None, Mismatch | None]], int, int, dict[str, str]]:
    """Compare traced runs of one command (the first the reference, run to the end from step 0): (the reference's
    own ranks' first disagreement or None; for each other run, its first mismatch or None and its first differing
    parameter when the mismatch is another record; steps compared, parameters per step; by label, the first
    parameter of each run that did not record every parameter by its global name and bits, a sharded DTensor's
    through its shards' parts). A run resumed
    after step K is compared from K on, a run stopped after step K up to K."""
    grad_norm = not any(r.mesh.local_norms for r in runs)
    records: dict[str, dict[Key, str]] = {}
    inner: dict[str, Mismatch | None] = {}
    shapes: dict[str, Shapes] = {}
    unsharded: Shapes = {}
    """The shapes the unsharded runs give their parameters: what a sharded run's replicas are recorded with."""
    for run in sorted(runs, key=lambda r: r.mesh.shards):  # the unsharded runs first (stable: in their order)
        records[run.label], inner[run.label], shapes[run.label] = _records(run.path, run.mesh, grad_norm=grad_norm,
                                                                           label=run.label, replicas=unsharded)
        if not run.mesh.shards:
            for name, shape in shapes[run.label].items():
                unsharded.setdefault(name, shape)
    for run in runs:
        _same_model(runs[0], shapes[runs[0].label], run, shapes[run.label])
    # A sharded run's parameters are compared per step where it recorded them globally (a sharded DTensor, through
    # its shards' parts; a replica); the others (each rank's own shard under one name: the reference trainer's
    # experts and flat shards) are not.
    names = {label: {name for _, kind, name in recorded if kind == "param"} for label, recorded in records.items()}
    partial = {run.label: min(set(shapes[run.label]) - names[run.label]) for run in runs
               if not names[run.label] >= set(shapes[run.label])}
    if not runs[0].mesh.shards and not names[runs[0].label]:
        raise CommandFailed(f"CMD recorded no parameters after an optimizer step ({runs[0].label}): does it "
                            "step a torch.optim optimizer?")
    reference = records[runs[0].label]
    compared: list[tuple[Mismatch | None, Mismatch | None]] = []
    tensors: set[str] = set()
    for run in runs[1:]:
        until = run.until_step if run.until_step is not None else sys.maxsize
        common = names[runs[0].label] & names[run.label] if run.mesh.shards or runs[0].mesh.shards else None
        tensors |= names[runs[0].label] if common is None else common

        def kept(key: Key, common: set[str] | None = common, until: int = until, start: int = run.from_step) -> bool:
            return start <= key[0] < until and (key[1] not in ("param", "final") or common is None or key[2] in common)

        expected = {key: bits for key, bits in reference.items() if kept(key)}
        first, first_param = inner[run.label], None
        if first is None:
            other = {key: bits for key, bits in records[run.label].items() if kept(key)}
            differences = _differences(*_losses(expected, other), run)
            first = next(differences, None)
            if first is not None and first.kind != "param":
                first_param = next((m for m in differences if m.kind == "param"), None)
        compared.append((first, first_param))
    steps = {step for step, kind, _ in reference if kind not in ("scaled", "final")}
    return inner[runs[0].label], compared, len(steps), len(tensors), partial


def compare_runs(runs: dict[int, Path]) -> tuple[Mismatch | None, int, int]:
    """`compare` for runs of one command at several world sizes ({world: run directory}, the first the
    reference)."""
    inner, compared, steps, tensors, _ = compare(tuple(Run(label=f"world {w}", mesh=Mesh(dp=w), path=p)
                                                    for w, p in runs.items()))
    return next((m for m in (inner, *(first for first, _ in compared)) if m is not None), None), steps, tensors
