"""`detrace.diff(a, b)`: open both runs, refuse incomparable ones, align every rank, order the results causally."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from detrace.compare.align import align_rank
from detrace.compare.causality import resolve
from detrace.compare.pool import default_workers, map_ranks
from detrace.compare.result import Compared, DiffResult
from detrace.errors import UsageError
from detrace.tracefile import RunInfo, open_run, rank_path
from detrace.tracefile.reader import read_footer


def _facts(run: RunInfo) -> dict[str, Any]:
    """What must agree for two runs to be comparable record by record, by how a sentence names it."""
    header = run.header
    windows = header.get("windows") or {}
    return {"trace schema": header.get("schema"), "rung": header.get("rung"),
            "step windows": windows.get("steps"), "rank window": windows.get("ranks", header.get("ranks")),
            "--max-numel": windows.get("max_numel")}


def _layout(run: RunInfo, rank: int) -> Any:
    """The process groups a rank used (its footer's "groups"): the parallel layout as the trace saw it."""
    footer = read_footer(run.path, rank)
    return footer.get("groups") if footer else None


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def incomparable(a: RunInfo, b: RunInfo) -> str | None:
    """Why two runs cannot be compared record by record (one sentence), or None."""
    if a.world_size != b.world_size:
        return f"{a.path} has world size {a.world_size} and {b.path} has world size {b.world_size}."
    facts_a, facts_b = _facts(a), _facts(b)
    for what, value in facts_a.items():
        other = facts_b[what]
        if value is not None and other is not None and value != other:
            return f"{a.path} was recorded with {what} {_short(value)} and {b.path} with {what} {_short(other)}."
    common = sorted(set(a.ranks) & set(b.ranks))
    if common:
        layout_a, layout_b = _layout(a, common[0]), _layout(b, common[0])
        if layout_a is not None and layout_b is not None and layout_a != layout_b:
            return (f"{a.path} and {b.path} have different parallel layouts: rank {common[0]} used process "
                    f"groups {_short(layout_a)} in one and {_short(layout_b)} in the other.")
    return None


def diff(a: str | Path, b: str | Path, *, rank: int | None = None, workers: int | None = None) -> DiffResult:
    """Compare two run directories and return where, if anywhere, their bits first differ.

    `rank` restricts the comparison to one rank. `workers` processes align ranks in parallel (default: every
    core when the runs are large enough to gain from it). Raises TraceError for a missing, empty or unreadable
    run directory; returns verdict "incomparable" for runs of different world sizes, schemas or layouts.
    """
    run_a, run_b = open_run(a), open_run(b)
    reason = incomparable(run_a, run_b)
    if reason is not None:
        return DiffResult(verdict="incomparable", reason=reason, a=str(a), b=str(b))
    ranks = sorted(set(run_a.ranks) | set(run_b.ranks))
    if rank is not None:
        if rank not in ranks:
            raise UsageError(f"rank {rank} has no trace in {a} or {b} (ranks traced: {_ranks(ranks)})")
        ranks = [rank]
    tasks = [(r, str(a), str(b), r in run_a.ranks, r in run_b.ranks) for r in ranks]
    if workers is not None and workers < 1:
        raise UsageError(f"workers must be at least 1, not {workers}")
    if workers is None:
        size = sum(rank_path(run.path, r).stat().st_size for r in ranks for run in (run_a, run_b)
                   if r in run.ranks)
        workers = default_workers(len(tasks), size)
    outcomes = map_ranks(align_rank, tasks, workers=workers)
    results, origin_ranks, first = resolve(outcomes)
    verdict = "diverged" if first is not None else "identical"
    return DiffResult(verdict=verdict, first=first, origin_ranks=origin_ranks, ranks=results,
                      compared=Compared(len(results), sum(r.records for r in results),
                                        sum(r.unverified for r in results)), a=str(a), b=str(b))


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")
