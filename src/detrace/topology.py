"""`detrace check-topology`: the same bits at every data-parallel world size.

CMD runs under torchrun once per world size, traced at the semantic rung (which records every parameter after
each optimizer step, by qualified name, and the exact losses and gradient norm). Records are aligned by global
identity, not by rank: a parameter by (global step, qualified name); a loss by (global step, global microbatch
index), where rank r's k-th loss of a step is microbatch r * n + k when every rank computes n (the contiguous
blocks of `detrace.parallel`); the gradient norm by global step. Every rank of a run must hold the same
parameters (they are full replicas), and every run the same as the first world size's. A `final params HEX`
line in CMD's output, if every run prints one, is compared too.

The thread count per rank is set explicitly (OMP_NUM_THREADS; torchrun would set 1 only for 2+ processes):
a CPU kernel's bits may depend on it.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.numbers import parse_count
from detrace.tracefile.layout import prepare_out
from detrace.tracefile.reader import open_run, read_rank
from detrace.tracing.launch import run_traced

RUNG = "semantic"
"""The cheapest rung that records the parameters after every optimizer step."""
FINAL = re.compile(r"^final params ([0-9a-f]{16})\s*$", re.MULTILINE)

Progress = Callable[[str], None]
Key = tuple[int, str, str]
"""(global step, kind, name): kind is "loss", "grad_norm" or "param"; name the microbatch or parameter."""


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """The first record that differs."""

    step: int
    """Global step (0 is the first optimizer step), -1 for the final params line."""
    kind: str
    """loss, grad_norm, param, final params, or ranks (two ranks of one run disagree)."""
    name: str
    """The tensor's qualified name, the loss's global microbatch, or what is missing."""
    world: int
    """The world size whose run differs (from the first, or within itself for kind "ranks")."""
    detail: str

    def sentence(self, reference: int) -> str:
        where = "the final params line" if self.step < 0 else f"step {self.step}"
        what = {"param": f"tensor {self.name}", "loss": f"loss of microbatch {self.name}",
                "grad_norm": "grad_norm", "final params": "", "ranks": self.name}[self.kind]
        against = f"world {self.world}'s ranks disagree" if self.kind == "ranks" else \
            f"world {self.world} differs from world {reference}"
        return f"{against} at {where}{': ' + what if what else ''} ({self.detail})"


@dataclass(frozen=True, kw_only=True)
class TopologyResult:
    """The outcome of `detrace check-topology`."""

    worlds: tuple[int, ...]
    runs: dict[int, Path]
    steps: int
    """Global steps compared."""
    tensors: int
    """Parameters compared per step."""
    finals: dict[int, str | None]
    """Each run's `final params` line (None when it printed none)."""
    first: Mismatch | None

    @property
    def identical(self) -> bool:
        return self.first is None

    def to_json(self) -> dict[str, Any]:
        first = None if self.first is None else {
            "step": self.first.step, "kind": self.first.kind, "name": self.first.name, "world": self.first.world,
            "detail": self.first.detail}
        return {"schema": "detrace.check-topology/1", "identical": self.identical, "worlds": list(self.worlds),
                "runs": {str(w): str(p) for w, p in self.runs.items()}, "steps": self.steps,
                "tensors": self.tensors, "final_params": {str(w): f for w, f in self.finals.items()},
                "first": first}


def max_world() -> int:
    """The most processes this machine runs at once for check-topology: 4 per CPU core (gloo ranks on CPU; more
    only thrash, and a typo such as 64 would start 64 trainings)."""
    return 4 * (os.cpu_count() or 1)


def parse_worlds(text: str, *, force: bool = False) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4): at least two distinct positive world sizes, none above `max_world()` unless `force`."""
    worlds = tuple(parse_count(part) for part in text.split(","))
    if any(world is None for world in worlds):
        raise UsageError(f"--worlds must be comma-separated world sizes such as 1,2,4, not {text!r}")
    sizes = tuple(world for world in worlds if world is not None)
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise UsageError(f"--worlds needs two or more distinct positive world sizes, not {text!r}")
    if max(sizes) > max_world() and not force:
        raise UsageError(f"--worlds {text} would start {max(sizes)} processes, more than this machine's "
                         f"{os.cpu_count()} CPU cores run well (at most {max_world()}); pass --force to start them")
    return sizes


def torchrun_command(cmd: list[str], world: int) -> list[str]:
    """CMD started by torchrun on `world` processes of this machine (CMD itself, unchanged, in each)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "--no-python", *cmd]


def _bits(value: float) -> str:
    return "0x" + struct.pack(">d", value).hex()


def _records(run: Path, world: int) -> tuple[dict[Key, str], Mismatch | None]:
    """One run's records keyed by global identity (values as exact hex), and the first disagreement between
    its ranks."""
    info = open_run(run)
    if len(info.ranks) != world:
        raise TraceError(f"{run} holds traces of ranks {list(info.ranks)}, not of all {world} ranks")
    merged: dict[Key, str] = {}
    owner: dict[Key, int] = {}
    for rank in info.ranks:
        table = read_rank(run, rank).table
        params = table.filter(pc.and_(pc.equal(table["phase"], "optimizer"), pc.equal(table["role"], "param")))
        metrics = table.filter(pc.equal(table["role"], "metric"))
        keyed: dict[Key, str] = {}
        losses: dict[int, list[float]] = {}
        for row in metrics.select(["step", "name", "value"]).to_pylist():
            if row["name"] == "loss":
                losses.setdefault(row["step"], []).append(row["value"])
            elif row["name"] == "grad_norm":
                keyed[(row["step"], "grad_norm", "")] = _bits(row["value"])
        for step, values in losses.items():  # rank r computes the block [r n, (r + 1) n)
            for k, loss in enumerate(values):
                keyed[(step, "loss", str(rank * len(values) + k))] = _bits(loss)
        for row in params.select(["step", "name", "digest"]).to_pylist():
            digest = row["digest"]
            keyed[(row["step"], "param", row["name"])] = "none" if digest is None else f"{digest:016x}"
        for key, bits in keyed.items():
            if key[1] == "loss":  # each rank has its own microbatches' losses
                merged[key] = bits
            elif key not in merged:
                merged[key], owner[key] = bits, rank
            elif merged[key] != bits:
                return merged, Mismatch(step=key[0], kind="ranks", name=f"{key[1]} {key[2]}".strip(), world=world,
                                        detail=f"rank {owner[key]} {merged[key]}, rank {rank} {bits}")
    return merged, None


def _order(key: Key) -> tuple[int, int, int | str]:
    step, kind, name = key
    return step, ("loss", "grad_norm", "param").index(kind), int(name) if kind == "loss" else name


def _first_difference(ref: dict[Key, str], other: dict[Key, str], world: int) -> Mismatch | None:
    for key in sorted(set(ref) | set(other), key=_order):
        a, b = ref.get(key, "missing"), other.get(key, "missing")
        if a != b:
            step, kind, name = key
            return Mismatch(step=step, kind=kind, name=name, world=world, detail=f"{a} vs {b}")
    return None


def check_topology(cmd: list[str], *, worlds: tuple[int, ...], out: Path, threads: int = 1,
                   timeout: float | None = None, progress: Progress = lambda _: None) -> TopologyResult:
    """Run CMD at each world size and compare the runs record by record (see the module doc)."""
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check-topology -- python train.py")
    if Path(cmd[0]).name in ("torchrun", "mpirun", "srun") or "torch.distributed.run" in cmd[:3]:
        raise UsageError("give CMD without a launcher: check-topology starts it under torchrun itself")
    if threads < 1:
        raise UsageError(f"--threads must be positive, not {threads}")
    prepare_out(out, holds="runs")
    runs: dict[int, Path] = {}
    finals: dict[int, str | None] = {}
    for world in worlds:
        run = runs[world] = out / f"world-{world}"
        progress(f"world {world}: {run}")
        result = run_traced(torchrun_command(cmd, world), run, rung=RUNG, timeout=timeout, quiet=True,
                            env={"OMP_NUM_THREADS": str(threads)})
        if result.returncode != 0:
            raise CommandFailed(f"CMD at world size {world} exited with code {result.returncode}; its output ends "
                                f"with:\n{result.output_tail.rstrip()}")
        found = FINAL.findall(result.output_tail)
        finals[world] = found[-1] if found else None
    first, steps, tensors = compare_runs(runs)
    if first is None and all(finals.values()):
        odd = next((w for w in worlds if finals[w] != finals[worlds[0]]), None)
        if odd is not None:
            first = Mismatch(step=-1, kind="final params", name="", world=odd,
                             detail=f"{finals[worlds[0]]} vs {finals[odd]}")
    return TopologyResult(worlds=worlds, runs=runs, steps=steps, tensors=tensors, finals=finals, first=first)


def compare_runs(runs: dict[int, Path]) -> tuple[Mismatch | None, int, int]:
    """Compare traced runs of one command at several world sizes ({world: run directory}, the first the
    reference): (the first mismatch or None, steps compared, parameters per step)."""
    records: dict[int, dict[Key, str]] = {}
    first: Mismatch | None = None
    for world, run in runs.items():
        records[world], inner = _records(run, world)
        first = first or inner
    worlds = list(runs)
    reference = records[worlds[0]]
    if not any(kind == "param" for _, kind, _ in reference):
        raise CommandFailed(f"CMD recorded no parameters after an optimizer step at world size {worlds[0]}: does it "
                            "step a torch.optim optimizer?")
    for world in worlds[1:]:
        first = first or _first_difference(reference, records[world], world)
    steps = {step for step, _, _ in reference}
    tensors = {name for _, kind, name in reference if kind == "param"}
    return first, len(steps), len(tensors)
