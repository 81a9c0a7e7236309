"""Synthetic traces of a data-parallel training loop, written through the real writer.

The fixtures of the diff's unit tests and the workload of bench/diff.py: traces of any size, produced in
bulk (`RankWriter.add_batch`), with a known answer. Each step of each rank records, in order:

    forward   `ops` op calls (input, output) in modules layers.0-3      rung op
    metric    loss                                                       rung metrics
    backward  `ops` op calls (input, output)                             rung op
    collective  all_reduce of the gradient over every rank (input, output)   rung semantic
    optimizer   grad in, param out                                       rung semantic

Digests stand for data: forward, backward and the all_reduce input depend on the rank (each rank has its own
batch); the all_reduce output, the gradient and the parameter are the same on every rank.

`Fault` is an injected fault, named as such: one backward op on one rank at one step gets different output bits.
The difference then flows as it would in training: through the rest of that rank's backward into its all_reduce
input, out of the all_reduce into every rank, and into every record of every later step.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from detrace.errors import UsageError
from detrace.tracefile import ARROW_SCHEMA, RankWriter

_NAMES = ("aten.mm.default", "aten.add.Tensor")
_FLIP = np.uint64(0x5DEECE66D)


@dataclass(frozen=True, kw_only=True)
class SyntheticRun:
    """The shape of a synthetic run."""

    ranks: int = 2
    """World size."""
    steps: int = 4
    """Training steps."""
    ops: int = 8
    """Op calls per step in forward and again in backward."""
    batch_records: int = 4096
    """Records per written batch (the writer's default flush size)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "steps", "ops", "batch_records"):
            if getattr(self, name) < 1:
                raise UsageError(f"SyntheticRun.{name} must be at least 1, not {getattr(self, name)}")

    @property
    def records_per_step(self) -> int:
        return 4 * self.ops + 5

    @property
    def records_per_rank(self) -> int:
        return self.steps * self.records_per_step

    @property
    def group(self) -> str:
        """The all_reduce's process group: every rank, in the SPEC grammar."""
        return ",".join(map(str, range(self.ranks))) if self.ranks <= 16 else f"0-{self.ranks - 1}"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Injected fault: backward op `op` on `rank` at `step` produces different output bits in run B."""

    rank: int
    step: int
    op: int


@dataclass(frozen=True)
class _Template:
    """The columns every rank shares, and which records depend on the rank."""

    columns: dict[str, pa.Array]
    step: np.ndarray
    kind: np.ndarray  # 0 forward/metric, 1 backward op, 2 all_reduce input, 3 all_reduce output, 4 optimizer
    op: np.ndarray  # backward op index, -1 elsewhere
    role_output: np.ndarray
    metric: np.ndarray


@functools.lru_cache(maxsize=4)
def _template(run: SyntheticRun) -> _Template:
    step_rows: list[tuple] = []  # (rung, phase, module, name, occurrence, role, kind, op, collective_done)
    for phase, kind in (("forward", 0), ("backward", 1)):
        for k in range(run.ops):
            for role in ("input", "output"):
                step_rows.append(("op", phase, f"layers.{k % 4}", _NAMES[k % 2], k // 4, role, kind,
                                  k if kind else -1, 0))
        if phase == "forward":
            step_rows.append(("metrics", "forward", None, "loss", 0, "metric", 0, -1, 0))
    step_rows.append(("semantic", "collective", None, "all_reduce", 0, "input", 2, -1, 0))
    step_rows.append(("semantic", "collective", None, "all_reduce", 0, "output", 3, -1, 1))
    step_rows.append(("semantic", "optimizer", None, "sgd", 0, "grad", 4, -1, 1))
    step_rows.append(("semantic", "optimizer", None, "sgd", 0, "param", 4, -1, 1))
    per_step = len(step_rows)
    n = per_step * run.steps
    rung, phase, module, name, occurrence, role, kind, op, done = (list(c) for c in zip(*step_rows, strict=True))
    seq = np.arange(n, dtype=np.int64)
    step = seq // per_step
    # A call's input and output share `event` (the seq of its first record); the metric is its own call.
    first_of_call = np.array([r != "output" and r != "param" for r in role] * run.steps)
    event = np.maximum.accumulate(np.where(first_of_call, seq, 0))
    is_collective = np.array([p == "collective" for p in phase] * run.steps)
    is_metric = np.array([r == "metric" for r in role] * run.steps)
    tile = functools.partial(np.tile, reps=run.steps)
    columns = {
        "seq": pa.array(seq),
        "step": pa.array(step),
        "rung": pa.array(rung * run.steps),
        "phase": pa.array(phase * run.steps),
        "module": pa.array(module * run.steps, type=pa.string()),
        "name": pa.array(name * run.steps),
        "occurrence": pa.array(tile(np.array(occurrence, dtype=np.int32))),
        "event": pa.array(event),
        "role": pa.array(role * run.steps),
        "index": pa.array(np.zeros(n, dtype=np.int32)),
        "shape": pa.array([[] if r == "metric" else [64, 64] for r in role] * run.steps, type=pa.list_(pa.int64())),
        "dtype": pa.array(["float64" if r == "metric" else "float32" for r in role] * run.steps),
        "numel": pa.array(tile(np.array([1 if r == "metric" else 4096 for r in role], dtype=np.int64))),
        "chunks": pa.nulls(n, pa.list_(pa.uint64())),
        "collectives": pa.array(step + tile(np.array(done, dtype=np.int64))),
        "group": pa.array(np.where(is_collective, run.group, None), type=pa.string()),
        "group_seq": pa.array(np.where(is_collective, step, 0), mask=~is_collective, type=pa.int64()),
        "peer": pa.nulls(n, pa.int32()),
        "extra": pa.nulls(n, pa.string()),
    }
    return _Template(columns=columns, step=step, kind=tile(np.array(kind)), op=tile(np.array(op)),
                     role_output=np.array([r == "output" for r in role] * run.steps), metric=is_metric)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64: well-spread stand-ins for digests."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rank_table(run: SyntheticRun, rank: int, fault: Fault | None = None) -> pa.Table:
    """The records of one rank; with `fault`, those of run B in which the injected fault happened."""
    t = _template(run)
    per_rank = t.kind <= 2  # forward, metric, backward and the all_reduce input depend on the rank's data
    seed = np.arange(len(t.step), dtype=np.uint64) + np.where(per_rank, np.uint64(rank + 1) << np.uint64(40),
                                                               np.uint64(0))
    changed = np.zeros(len(t.step), dtype=bool)
    if fault is not None:
        at = t.step == fault.step
        if rank == fault.rank:
            # the faulty op's output, then every later backward record and the gradient it sends
            after = (t.kind == 1) & ((t.op > fault.op) | ((t.op == fault.op) & t.role_output))
            changed |= at & (after | (t.kind == 2))
        changed |= at & (t.kind >= 3)
        changed |= t.step > fault.step
    digest = _mix(seed) ^ np.where(changed, _FLIP, np.uint64(0))
    value = (digest >> np.uint64(11)).astype(np.float64) * 2.0**-53
    columns = dict(t.columns)
    columns["digest"] = pa.array(digest, mask=t.metric)
    columns["value"] = pa.array(value, mask=~t.metric)
    return pa.table([columns[field.name] for field in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def write_table(out: str | Path, rank: int, table: pa.Table, *, world_size: int, close: bool = True,
                batch_records: int = 4096) -> None:
    """Write records (a table of the trace schema) as one rank's trace; `close=False` leaves it without footer,
    as a rank that died after its last flush does."""
    writer = RankWriter(out, rank, header={"world_size": world_size, "rung": "op", "synthetic": True})
    for batch in table.to_batches(max_chunksize=batch_records):
        writer.add_batch(batch)
    if close:
        writer.close()


def write_rank(out: str | Path, run: SyntheticRun, rank: int, fault: Fault | None = None) -> int:
    """Write one rank's trace under `out` through the real writer; return its record count."""
    table = rank_table(run, rank, fault)
    write_table(out, rank, table, world_size=run.ranks, batch_records=run.batch_records)
    return table.num_rows


def write_run(out: str | Path, run: SyntheticRun, fault: Fault | None = None) -> int:
    """Write every rank of a synthetic run; return the number of records written."""
    return sum(write_rank(out, run, rank, fault) for rank in range(run.ranks))


@dataclass(frozen=True, kw_only=True)
class TrainingStep:
    """What one rank records in one optimizer step at the semantic rung: what check-topology compares."""

    step: int
    """Global step (optimizer steps completed before it)."""
    losses: tuple[float, ...] = ()
    """The rank's microbatch losses, in order."""
    grad_norm: float | None = None
    params: dict[str, int] | None = None
    """Parameter name -> digest after the optimizer step."""
    buffers: dict[str, int] | None = None
    """Module buffer name -> digest as the step ends (role "buffer")."""
    shapes: dict[str, tuple[int, ...]] | None = None
    """Parameter name -> the shape the rank records it with (default [4]): a plain shard's is its own part's."""
    final: dict[str, int] | None = None
    """Parameter name -> digest as the run ended (phase "final", recorded in this step: the last)."""


def write_training_rank(out: str | Path, rank: int, steps: list[TrainingStep], *, world_size: int) -> None:
    """One rank's trace of losses, gradient norm and parameters per step, through the real writer."""
    rows: list[dict[str, object]] = []

    def add(step: int, rung: str, phase: str, name: str, role: str, occurrence: int, *, digest: int | None = None,
            value: float | None = None, shape: tuple[int, ...] = (4,)) -> None:
        seq = len(rows)
        rows.append({"seq": seq, "step": step, "rung": rung, "phase": phase, "module": None, "name": name,
                     "occurrence": occurrence, "event": seq, "role": role, "index": 0,
                     "shape": [] if value is not None else list(shape), "dtype": "float32",
                     "numel": 1 if value is not None else math.prod(shape), "digest": digest, "chunks": None,
                     "value": value, "collectives": 0, "group": None,
                     "group_seq": None, "peer": None, "extra": None})

    for s in steps:
        for k, loss in enumerate(s.losses):
            add(s.step, "metrics", "backward", "loss", "metric", k, value=loss)
        if s.grad_norm is not None:
            add(s.step, "metrics", "optimizer", "grad_norm", "metric", 0, value=s.grad_norm)
        for k, (name, digest) in enumerate((s.params or {}).items()):
            shape = (s.shapes or {}).get(name, (4,))
            add(s.step, "semantic", "optimizer", name, "param", k, digest=digest, shape=shape)
        for k, (name, digest) in enumerate((s.buffers or {}).items()):
            add(s.step, "semantic", "optimizer", name, "buffer", k, digest=digest)
        for k, (name, digest) in enumerate((s.final or {}).items()):
            add(s.step, "semantic", "final", name, "param", k, digest=digest)
    table = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
    write_table(out, rank, table, world_size=world_size)


def with_metric(table: pa.Table, values: dict[int, float], *, first: int = 0) -> pa.Table:
    """`table` with its loss records carrying `values` (step -> value; steps missing there keep theirs) and only
    the records of steps `first` on: a run resumed from the checkpoint after `first` steps."""
    steps = table["step"].to_numpy()
    old = table["value"].to_pylist()
    metric = (table["role"].to_numpy(zero_copy_only=False) == "metric")
    new = [values.get(int(s), v) if m else v for s, v, m in zip(steps, old, metric, strict=True)]
    table = table.set_column(table.schema.get_field_index("value"), "value", pa.array(new, type=pa.float64()))
    return table.filter(pa.array(steps >= first))


def with_samples(table: pa.Table, samples: dict[int, list[int]]) -> pa.Table:
    """`table` with a "samples" record (phase data, the batch rung's) opening each step of `samples`: the dataset
    indices of its batch, a digest standing for them."""
    rows = table.to_pylist()
    out: list[dict[str, object]] = []
    for row in rows:
        step = row["step"]
        if step in samples and (not out or out[-1]["step"] != step):
            indices = samples[step]
            digest = int(_mix(np.array([hash(tuple(indices)) & 0xFFFF_FFFF], dtype=np.uint64))[0])
            out.append({**row, "rung": "semantic", "phase": "data", "module": None, "name": "samples",
                        "occurrence": 0, "role": "input", "index": 0, "shape": [len(indices)], "dtype": "int64",
                        "numel": len(indices), "digest": digest, "chunks": None, "value": None,
                        "extra": json.dumps({"samples": indices})})
        out.append(row)
    for seq, row in enumerate(out):
        row["seq"] = row["event"] = seq
    return pa.Table.from_pylist(out, schema=ARROW_SCHEMA)


def write_metric_run(out: str | Path, values: dict[int, float], *, ranks: int = 1, fault: Fault | None = None,
                     first: int = 0, ops: int = 2, samples: dict[int, list[int]] | None = None) -> None:
    """A synthetic run over the steps of `values` (0..max) whose loss on every rank has those values, from step
    `first` on (a resumed run), with `fault` in it if given, and the dataset indices of each step's batch of
    `samples` recorded."""
    run = SyntheticRun(ranks=ranks, steps=max(values) + 1, ops=ops)
    for rank in range(ranks):
        table = with_metric(rank_table(run, rank, fault), values, first=first)
        write_table(out, rank, with_samples(table, samples) if samples else table, world_size=ranks)
