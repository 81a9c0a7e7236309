"""Two runs' records matched by identity, whatever their order: per-step spread, origin calls, equal windows.

The diff (engine.py) aligns records by position and resynchronises after a structural change; this is the
order-free view that `detrace locate` and the report need beside it: how many records of each step differ, the
first op call whose inputs match and whose output differs, and whether two runs agree over a window of steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze.classify import IDENTITY, INPUT_ROLES, OUTPUT_ROLES, content_mask, label
from detrace.analyze.diff_result import Divergence
from detrace.tracefile import open_run, read_rank


def aligned_records(run_a: str | Path, run_b: str | Path, rank: int, *,
                    steps: tuple[int, int] | None = None) -> tuple[pa.Table, np.ndarray, int, int]:
    """One rank's records of two runs matched by identity (the A side of each pair, in A's order), whether each
    pair carries the same bits (`detrace.analyze.classify.content_mask`), and how many records of A and of B
    found no partner. Positional alignment and resynchronisation are the diff's business; this is the
    order-free view that per-step counts and the search for an origin call need. `steps` (first, last) keeps
    only the records of those steps: not the state a run ended with (phase "final"), which carries its last step's
    number but is no record of that step (a run that stops inside the window, as locate's resume proof does, ends
    there; the run it is compared with goes on).
    """
    ta, tb = read_rank(run_a, rank).table, read_rank(run_b, rank).table
    if steps is not None:
        ta, tb = (t.filter(pc.and_(pc.and_(pc.greater_equal(t["step"], steps[0]), pc.less_equal(t["step"], steps[1])),
                                   pc.not_equal(t["phase"], "final")))
                  for t in (ta, tb))

    def keys(table: pa.Table, position: str) -> pa.Table:
        columns = {name: table[name] for name in IDENTITY}
        # a join never matches null with null: records outside any module get ""
        columns["module"] = pc.fill_null(table["module"], "")
        columns[position] = pa.array(np.arange(table.num_rows, dtype=np.int64))
        return pa.table(columns)

    joined = keys(ta, "_a").join(keys(tb, "_b"), keys=list(IDENTITY), join_type="inner").sort_by("_a")
    a = ta.take(joined["_a"]).combine_chunks()
    b = tb.take(joined["_b"]).combine_chunks()
    if a.num_rows == 0:
        return a, np.zeros(0, dtype=bool), ta.num_rows, tb.num_rows
    equal = content_mask(a.to_batches()[0], b.to_batches()[0])
    return a, equal, ta.num_rows - a.num_rows, tb.num_rows - b.num_rows


def first_origin_call(run_a: str | Path, run_b: str | Path, rank: int) -> Divergence | None:
    """The first op call, in A's execution order, whose input records all match and an output record differs.

    The diff names the first *record* that differs and walks back from it; when that record is an input whose
    difference went nowhere (the uninitialised memory an in-place fill such as `uniform_` overwrites: inputs
    differ, outputs equal), it finds no origin. This search skips such absorbed differences.
    """
    table, equal, _, _ = aligned_records(run_a, run_b, rank)
    if not table.num_rows:
        return None
    rows = table.select(["seq", "event", "rung", "role"]).to_pylist()
    inputs_differ: set[int] = set()
    for row, same in zip(rows, equal.tolist(), strict=True):
        if not same and row["role"] in INPUT_ROLES:
            inputs_differ.add(row["event"])
    for i, (row, same) in enumerate(zip(rows, equal.tolist(), strict=True)):
        if (not same and row["rung"] == "op" and row["role"] in OUTPUT_ROLES
                and row["event"] not in inputs_differ):
            found = table.slice(i, 1).to_pylist()[0]
            return Divergence(rank=rank, step=found["step"], seq=found["seq"], rung=found["rung"],
                              phase=found["phase"], kind="numeric", name=found["name"], module=found["module"],
                              role=found["role"], origin=True, occurrence=found["occurrence"],
                              index=found["index"], event=found["event"], collectives=found.get("collectives") or 0)
    return None


def same_over(run_a: str | Path, run_b: str | Path, first: int, last: int) -> str | None:
    """Whether two runs recorded the same records with the same bits in steps `first`..`last`, whatever each
    recorded outside them (one may have started there, resumed from a checkpoint). None when they did; else
    where they first differ, in one phrase."""
    ranks_a, ranks_b = open_run(run_a).ranks, open_run(run_b).ranks
    if sorted(ranks_a) != sorted(ranks_b):
        return f"ranks {ranks_spec(ranks_a)} against ranks {ranks_spec(ranks_b)}"
    compared = 0
    for rank in sorted(ranks_a):
        table, equal, only_a, only_b = aligned_records(run_a, run_b, rank, steps=(first, last))
        if not equal.all():
            row = table.slice(int(np.argmin(equal)), 1).to_pylist()[0]
            return f"rank {rank}, step {row['step']}: {label(row)} differs"
        if only_a or only_b:
            return f"rank {rank}: {only_a} records of run A and {only_b} of the resumed run have no partner"
        compared += table.num_rows
    return None if compared else f"no records in steps {first}-{last}"


def ranks_spec(ranks: Iterable[int]) -> str:
    """Ranks as a window spec: "0,2,3"."""
    return ",".join(str(r) for r in sorted(set(ranks)))


def divergence_map(run_a: str | Path, run_b: str | Path) -> dict[int, dict[int, tuple[int, int]]]:
    """rank -> step -> (records that differ, records compared), records matched by identity.

    A record differs when its bits differ or when only one run has it. The counts show how a divergence spreads;
    which record came *first* (and whether it is an origin) is `detrace.diff`'s answer.
    """
    ranks_a, ranks_b = open_run(run_a).ranks, open_run(run_b).ranks
    spread: dict[int, dict[int, tuple[int, int]]] = {}
    for rank in sorted(set(ranks_a) | set(ranks_b)):
        if rank not in ranks_a or rank not in ranks_b:
            spread[rank] = {}
            continue
        table, equal, _, _ = aligned_records(run_a, run_b, rank)
        matched = Counter(table["step"].to_pylist())
        differ = Counter(step for step, same in zip(table["step"].to_pylist(), equal.tolist(), strict=True)
                         if not same)
        # records of one run without a partner (a changed call sequence, a truncated run) differ too
        unmatched: Counter[int] = Counter()
        for run in (run_a, run_b):
            unmatched += Counter(read_rank(run, rank).table["step"].to_pylist()) - matched
        counts = {step: (differ[step] + unmatched[step], matched[step] + unmatched[step])
                  for step in matched.keys() | unmatched.keys()}
        spread[rank] = counts
    return spread
