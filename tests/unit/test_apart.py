"""Checkpoint I/O and framework bookkeeping are recorded in phases of their own and compared apart from the
training, by identity: a resumed process that loaded a checkpoint, a continuous one that saved one, and a
framework's logging gather made at another place are never a divergence; a real difference in training still is."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _synthetic import Fault, SyntheticRun, rank_table, write_table

import detrace
from detrace.analyze import diff
from detrace.tracefile import ARROW_SCHEMA, read_rank

RUN = SyntheticRun(ranks=2, steps=4, ops=4)


def _set_aside(rows: list[dict[str, Any]], *, step: int, at: int, phase: str, names: list[str],
               digest: int = 7) -> list[dict[str, Any]]:
    """`rows` with one call per name of `phase` inserted before the `at`-th record of `step`."""
    where = [i for i, row in enumerate(rows) if row["step"] == step][at]
    extra = []
    for k, name in enumerate(names):
        for role in ("input", "output"):
            extra.append({**rows[where], "phase": phase, "rung": "semantic", "module": None, "name": name,
                          "occurrence": names[:k].count(name), "role": role, "index": 0, "digest": digest + k,
                          "value": None, "shape": [2], "numel": 2, "dtype": "float32", "chunks": None})
    out = rows[:where] + extra + rows[where:]
    return [{**row, "seq": i, "event": i} for i, row in enumerate(out)]


def _write(out: Path, tables: list[list[dict[str, Any]]]) -> Path:
    for rank, rows in enumerate(tables):
        write_table(out, rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=len(tables))
    return out


def _resumed_pair(tmp_path: Path, fault: Fault | None = None) -> tuple[Path, Path]:
    """A: a continuous run that saves a checkpoint in step 1's trailing work and logs through a framework gather at
    the end of every step. B: resumed at step 2, its checkpoint load first, its framework gathers elsewhere."""
    tables_a, tables_b = [], []
    for rank in range(RUN.ranks):
        a = rank_table(RUN, rank).to_pylist()
        for step in range(RUN.steps):
            a = _set_aside(a, step=step, at=-1, phase="bookkeeping", names=["all_gather"], digest=100 + step)
        a = _set_aside(a, step=1, at=-1, phase="checkpoint", names=["all_gather", "broadcast"])
        b = [row for row in rank_table(RUN, rank, fault).to_pylist() if row["step"] >= 2]
        b = _set_aside(b, step=2, at=0, phase="checkpoint", names=["all_reduce", "all_reduce", "scatter", "gather"])
        for step in (2, 3):
            b = _set_aside(b, step=step, at=0, phase="bookkeeping", names=["all_gather"], digest=100 + step)
        tables_a.append(a)
        tables_b.append(b)
    return _write(tmp_path / "a", tables_a), _write(tmp_path / "b", tables_b)


def test_checkpoint_io_and_bookkeeping_are_no_divergence(tmp_path: Path) -> None:
    a, b = _resumed_pair(tmp_path)
    result = diff(a, b)
    assert result.verdict == "identical", result.first
    assert result.compared.records == 2 * 2 * RUN.records_per_step  # steps 2-3, the training's records only
    assert ("compared apart from the training, by identity: checkpoint I/O: 0 records in A, 16 in B, 0 in both; "
            "framework bookkeeping collectives: 8 records in A, 8 in B, 8 in both, every bit equal") in result.notes


def test_a_real_difference_is_still_found_beside_them(tmp_path: Path) -> None:
    a, b = _resumed_pair(tmp_path, Fault(rank=1, step=3, op=2))
    result = diff(a, b)
    assert result.verdict == "diverged" and result.origin_ranks == [1]
    first = result.first
    assert first is not None and (first.step, first.phase, first.kind, first.origin) == (3, "backward", "numeric",
                                                                                           True)


def test_a_differing_bookkeeping_record_is_named_in_the_note(tmp_path: Path) -> None:
    a, b = _resumed_pair(tmp_path)
    rows = read_rank(b, 0).table.to_pylist()
    for row in rows:
        if row["phase"] == "bookkeeping" and row["step"] == 3 and row["role"] == "output":
            row["digest"] += 1
    c = _write(tmp_path / "c", [rows, read_rank(b, 1).table.to_pylist()])
    result = diff(a, c)
    assert result.verdict == "identical"
    assert any("bookkeeping collectives: 8 records in A, 8 in B, 8 in both, of which 1 differ (first: step 3 "
               "bookkeeping all_gather#0 output[0])" in n for n in result.notes)


def _framework(name: str) -> Callable[[torch.Tensor], Any]:
    """A function defined in a module named `name` (a stand-in for a framework's own module) that all-reduces."""
    module = types.ModuleType(name)
    module.dist = dist  # type: ignore[attr-defined]
    exec("def log(x):\n    return dist.all_reduce(x)\n", module.__dict__)
    return module.log  # type: ignore[no-any-return]


def test_the_tracer_records_checkpoint_io_and_bookkeeping_in_their_phases(tmp_path: Path,
                                                                         free_port: Callable[[], int]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer_log = _framework("transformers.trainer")
        model_code = _framework("transformers.models.gpt2.modeling_gpt2")
        with detrace.trace(tmp_path / "t", rung="semantic"):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            trainer_log(torch.ones(2))  # HF's logging gather: bookkeeping
            model_code(torch.ones(2))  # a collective in model code: training
            dist.all_reduce(torch.ones(2))  # the user's own: training
            state = detrace.TrainState(model=model, optimizer=optimizer)
            state.save(tmp_path / "ckpt")
            with detrace.record.checkpoint_io():
                dist.broadcast(torch.ones(2), 0)
            dcp.save({"w": model.weight.detach().clone()}, checkpoint_id=tmp_path / "dcp")  # DCP called directly
    finally:
        dist.destroy_process_group()
    calls = [(r["phase"], r["name"]) for r in read_rank(tmp_path / "t", 0).table.to_pylist()
             if r["role"] == "input" and r["rung"] == "semantic" and r["phase"] != "data"]
    assert calls[:3] == [("bookkeeping", "all_reduce"), ("collective", "all_reduce"), ("collective", "all_reduce")]
    broadcast = calls.index(("checkpoint", "broadcast"))
    assert {phase for phase, _ in calls[3:]} == {"checkpoint"} and broadcast > 3  # TrainState: DCP's collectives
    assert len(calls) > broadcast + 1  # dcp.save called by the user's code: checkpoint I/O too


@pytest.mark.parametrize("phase", ["checkpoint", "bookkeeping", "evaluation"])
def test_the_schema_names_the_phases(phase: str) -> None:
    from detrace.tracefile import PHASES

    assert phase in PHASES
