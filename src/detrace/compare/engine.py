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

# Header facts that must agree for two runs to be comparable record by record: (key, how the sentence names it).
_MUST_AGREE = (
    ("schema", "trace schema"),
    ("rung", "rung"),
    ("steps", "step window"),
    ("ranks", "rank window"),
    ("max_numel", "--max-numel"),
)
_LAYOUT_KEYS = ("layout", "parallel_layout", "process_groups")


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def incomparable(a: RunInfo, b: RunInfo) -> str | None:
    """Why two runs cannot be compared record by record (one sentence), or None."""
    if a.world_size != b.world_size:
        return f"{a.path} has world size {a.world_size} and {b.path} has world size {b.world_size}."
    for key, what in _MUST_AGREE:
        if key in a.header and key in b.header and a.header[key] != b.header[key]:
            return (f"{a.path} was recorded with {what} {_short(a.header[key])} "
                    f"and {b.path} with {what} {_short(b.header[key])}.")
    for key in _LAYOUT_KEYS:
        if key in a.header and key in b.header and a.header[key] != b.header[key]:
            return (f"{a.path} and {b.path} have different parallel layouts "
                    f"({_short(a.header[key])} vs {_short(b.header[key])}).")
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
                      compared=Compared(len(results), sum(r.records for r in results)), a=str(a), b=str(b))


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")
