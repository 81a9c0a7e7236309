"""Per-rank streaming alignment of two runs: find the first divergence, resynchronise, keep comparing.

Both rank files are read batch by batch (`tracefile.iter_batches`); memory holds a few batches per side and a
bounded look-ahead window, never a whole run. Aligned slices are compared column by column in C++ (`same`):
on identical traces nothing else runs. Where a slice differs, row masks say which records differ (numeric) and
where the identities stop matching (structural); only those rows reach Python.

First divergence and walk-back: the first numeric divergence D1 of a rank is either an origin (an output-side
record whose call's inputs all matched) or a receiver (an input that already differed, or an output of a call
fed by one). For a receiver we walk back to the innermost *enclosing* call that began before D1, whose inputs
matched and whose output differs: e.g. a module whose forward computes something untraced between two traced
children. Enclosing calls close in LIFO order, so the first such output record after D1 is the innermost one;
the search ends with D1's step. A collective's output that differs while its inputs on this rank matched is
never an origin here: the divergence came from a peer, which causality.py decides across ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze import apart
from detrace.analyze.classify import (
    COMMUNICATION,
    IDENTITY,
    INPUT_ROLES,
    OUTPUT_ROLES,
    content_mask,
    differences,
    identity_mask,
    label,
    same,
    tensor_label,
)
from detrace.analyze.cursor import RankCursor
from detrace.analyze.diff_result import Divergence
from detrace.tracefile import RankFile

LOOKAHEAD = 4096
"""Records per side searched for a common identity after a structural divergence; beyond it both runs skip to
the next step. Bounds the memory and time a resynchronisation costs."""
MAX_CALL_TENSORS = 16
"""Input/output tensors of the divergent call listed in the detail."""

_INPUT_SET = pa.array(sorted(INPUT_ROLES))
_ORIGIN_SET = pa.array(sorted(OUTPUT_ROLES - {"metric"}))  # a metric observes a value, it computes nothing
_COMMUNICATION_SET = pa.array(sorted(COMMUNICATION))


@dataclass(frozen=True)
class Link:
    """The collective or send/recv through which a divergence may have reached a rank."""

    name: str
    phase: str
    group: str | None
    group_seq: int | None
    peer: int | None

    def __str__(self) -> str:
        text = f"{self.name}#{self.group_seq if self.group_seq is not None else '?'}"
        if self.group:
            text += f" group {self.group}"
        if self.phase == "p2p" and self.peer is not None:
            text += f" from rank {self.peer}"
        return text


@dataclass(kw_only=True)
class RankOutcome:
    """What one rank's alignment found; causality.py turns the outcomes of all ranks into RankResults."""

    rank: int
    first: Divergence | None = None
    link: Link | None = None
    """Set when `first` is the output of a collective/p2p call whose inputs on this rank matched."""
    records: int = 0
    unverified: int = 0
    numeric: int = 0
    structural: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    """Process group -> first group_seq of a collective whose input on this rank differed."""
    sent_to: dict[int, int] = field(default_factory=dict)
    """Peer rank -> first group_seq of a send whose data on this rank differed."""
    apart: apart.Apart | None = None
    """The records compared apart from the training (checkpoint I/O, framework bookkeeping), if any."""
    layout: str | None = None
    """The first DDP bucket layout change, in one sentence (its buckets were not compared; the per-parameter
    gradients were)."""


def _unverified(batch: pa.RecordBatch) -> int:
    """Records with neither a digest nor a metric value: nothing of theirs can be compared. From the columns'
    null counts (bitmap pop-counts), so the fast path stays a pass of C++."""
    return max(0, batch.column("digest").null_count + batch.column("value").null_count - batch.num_rows)


def _row(batch: pa.RecordBatch | pa.Table, i: int) -> dict[str, Any]:
    return batch.slice(i, 1).to_pylist()[0]


def _divergence(rank: int, row: dict[str, Any], *, kind: str, origin: bool, detail: dict[str, Any]) -> Divergence:
    return Divergence(rank=rank, step=row["step"], seq=row["seq"], rung=row["rung"], phase=row["phase"],
                      # mypy, ignored below: every caller passes a Kind literal
                      kind=kind, name=row["name"], module=row["module"], role=row["role"], origin=origin,  # type: ignore[arg-type]
                      occurrence=row["occurrence"], index=row["index"], event=row["event"],
                      collectives=row["collectives"], detail=detail)


def _is_origin(row: dict[str, Any]) -> bool:
    """An output-side record, first to differ, of a call that is not a collective: its inputs matched."""
    return row["role"] in OUTPUT_ROLES and row["role"] != "metric" and row["phase"] not in COMMUNICATION


class RankAligner:
    """Aligns one rank of run A with the same rank of run B."""

    def __init__(self, rank: int, a: RankFile | None, b: RankFile | None, *,
                 steps: tuple[int, int | None] = (0, None), stopped: tuple[str, int, int, int] | None = None) -> None:
        """`a`, `b`: the rank in each opened run (`RunInfo.files`), None where that run has no trace of it.
        `stopped`: ("A" or "B", its last step, the other's last step, its first step) when that run closed its trace
        before the other's last step (`engine.stopped_early`): its stop is a divergence when nothing differs before."""
        self.rank = rank
        self.stopped = stopped
        self.a_file = a
        self.a = RankCursor(a, end=steps[1])
        self.b = RankCursor(b, end=steps[1])
        self.start = steps[0]
        """The first global step compared: both runs' records of earlier steps are skipped."""
        self.outcome = RankOutcome(rank=rank)
        # First numeric divergence (rows of A and B, and its position in A), and the origin found for it.
        self._d1: tuple[dict[str, Any], dict[str, Any], int] | None = None
        self._origin: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._walking = False
        self._open_inputs: set[int] = set()  # calls begun before D1 whose inputs differ
        # First structural or missing divergence and its position in A.
        self._other: tuple[Divergence, int] | None = None
        self._last: pa.RecordBatch | None = None  # the last aligned slice of A

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        if self.start:
            self.a.skip_to_step(self.start)
            self.b.skip_to_step(self.start)
        while (ha := self.a.head()) is not None and (hb := self.b.head()) is not None:
            n = min(ha.num_rows, hb.num_rows)
            sa, sb = ha.slice(0, n), hb.slice(0, n)
            if same(sa, sb):
                self._aligned(sa, sb, None)
                self.a.advance(n)
                self.b.advance(n)
                continue
            ident = identity_mask(sa, sb)
            if self._layout_changed(sa, sb, ident):
                continue
            m = n if ident.all() else int(np.argmin(ident))
            if m:
                sa, sb = sa.slice(0, m), sb.slice(0, m)
                self._aligned(sa, sb, content_mask(sa, sb))
                self.a.advance(m)
                self.b.advance(m)
            if m < n:
                self._resync()
        self._tail()
        self.outcome.apart = apart.compare(self.a.apart, self.b.apart, start=self.start)
        return self._finish()

    def _aligned(self, sa: pa.RecordBatch, sb: pa.RecordBatch, equal: np.ndarray | None) -> None:
        """Account for aligned records; `equal` is None when the fast path found every record equal."""
        self.outcome.records += sa.num_rows
        self.outcome.unverified += max(_unverified(sa), _unverified(sb))
        self._last = sa
        differ = np.flatnonzero(~equal) if equal is not None else np.empty(0, dtype=np.int64)
        if differ.size:
            self.outcome.numeric += int(differ.size)
            self._track_sent(sa, differ)
            if self._d1 is None:
                i = int(differ[0])
                ra, rb = _row(sa, i), _row(sb, i)
                self._d1 = (ra, rb, self.a.position + i)
                if _is_origin(ra):
                    self._origin = (ra, rb)
                elif ra["phase"] == "data":
                    self._walking = False  # the data entered from outside the traced calls: nothing to walk back to
                else:
                    # A collective's output that differs with equal inputs came from a peer: no walking back.
                    self._walking = not (ra["phase"] in COMMUNICATION and ra["role"] in OUTPUT_ROLES)
                    if ra["role"] in INPUT_ROLES:
                        self._open_inputs.add(ra["event"])  # D1's own call is fed by it: not an origin
                differ = differ[1:]
            if self._walking and differ.size:
                self._walk(sa, sb, differ)
        # mypy, ignored below: _walking is only true once _d1 is set
        if self._walking and int(sa.column("step")[-1].as_py()) > self._d1[0]["step"]:  # type: ignore[index]
            self._walking = False  # no enclosing call of D1's step made the difference

    def _walk(self, sa: pa.RecordBatch, sb: pa.RecordBatch, differ: np.ndarray) -> None:
        """Look for the innermost call that began before D1, had equal inputs and a differing output."""
        d1 = self._d1[0]  # type: ignore[index]  # _walk runs only while _walking, so _d1 is set
        rows = sa.take(pa.array(differ))
        events = rows.column("event").to_numpy()
        before = (events < d1["seq"]) & (rows.column("step").to_numpy() == d1["step"])
        inputs = before & pc.is_in(rows.column("role"), value_set=_INPUT_SET).to_numpy(zero_copy_only=False)
        self._open_inputs.update(events[inputs].tolist())
        candidates = (before & pc.is_in(rows.column("role"), value_set=_ORIGIN_SET).to_numpy(zero_copy_only=False)
                      & ~pc.is_in(rows.column("phase"), value_set=_COMMUNICATION_SET).to_numpy(zero_copy_only=False)
                      & ~np.isin(events, list(self._open_inputs)))
        if candidates.any():
            i = int(differ[int(np.argmax(candidates))])
            self._origin = (_row(sa, i), _row(sb, i))
            self._walking = False

    def _track_sent(self, sa: pa.RecordBatch, differ: np.ndarray) -> None:
        """Remember the first collective (per group) and send (per peer) whose data left this rank different."""
        phase = sa.column("phase").take(pa.array(differ))
        role = sa.column("role").take(pa.array(differ))
        mask = pc.and_(pc.is_in(phase, value_set=_COMMUNICATION_SET), pc.is_in(role, value_set=_INPUT_SET))
        picked = differ[mask.to_numpy(zero_copy_only=False)]
        if not picked.size:
            return
        for row in sa.select(["phase", "group", "group_seq", "peer"]).take(pa.array(picked)).to_pylist():
            seq = row["group_seq"] if row["group_seq"] is not None else -1
            if row["phase"] == "p2p" and row["peer"] is not None:
                self.outcome.sent_to[row["peer"]] = min(seq, self.outcome.sent_to.get(row["peer"], seq))
            elif row["group"] is not None:
                self.outcome.sent[row["group"]] = min(seq, self.outcome.sent.get(row["group"], seq))

    # -- DDP bucket layouts ---------------------------------------------------------------------------------
    def _layout_changed(self, sa: pa.RecordBatch, sb: pa.RecordBatch, ident: np.ndarray) -> bool:
        """Where the first differing record of two aligned slices is a DDP bucket reduction and the two runs'
        buckets of that backward hold other parameters (or in another order), skip both runs' bucket records of
        that backward, note the layout change and return True: a rebuilt layout is no numeric origin, and the
        gradients it produced are compared per parameter in the optimizer's grad records."""
        equal = ident.copy()
        equal[ident] = content_mask(sa.filter(pa.array(ident)), sb.filter(pa.array(ident)))
        if equal.all():
            return False
        k = int(np.argmin(equal))
        if not (_is_bucket(sa, k) or _is_bucket(sb, k)):
            return False
        buckets_a = _buckets(self.a.window(k + LOOKAHEAD).slice(k))
        buckets_b = _buckets(self.b.window(k + LOOKAHEAD).slice(k))
        if [layout for layout, _ in buckets_a] == [layout for layout, _ in buckets_b]:
            return False  # the same layout: its bits are compared as they are
        self._aligned(sa.slice(0, k), sb.slice(0, k), None)
        self.a.advance(k)
        self.b.advance(k)
        if self.outcome.layout is None:
            step = int(sa.column("step")[k].as_py())
            which = next((i for i, (x, y) in enumerate(zip(buckets_a, buckets_b, strict=False)) if x[0] != y[0]),
                         min(len(buckets_a), len(buckets_b)))
            self.outcome.layout = (
                f"rank {self.rank}, step {step}: the DDP bucket layout differs ({len(buckets_a)} buckets in A, "
                f"{len(buckets_b)} in B; bucket {which} holds {_params(buckets_a, which)} in A and "
                f"{_params(buckets_b, which)} in B): the buckets were not compared, the gradients per parameter were")
        self.a.advance(sum(rows for _, rows in buckets_a))
        self.b.advance(sum(rows for _, rows in buckets_b))
        return True

    # -- structural divergence ------------------------------------------------------------------------------
    def _resync(self) -> None:
        """The identities stopped matching: find the nearest record both runs share and skip to it."""
        wa, wb = self.a.window(LOOKAHEAD), self.b.window(LOOKAHEAD)
        keys_a = list(zip(*(wa.column(name).to_pylist() for name in IDENTITY), strict=True))
        keys_b = list(zip(*(wb.column(name).to_pylist() for name in IDENTITY), strict=True))
        where_b: dict[tuple, int] = {}
        for j, key in enumerate(keys_b):
            where_b.setdefault(key, j)
        best: tuple[int, int] | None = None
        for i, key in enumerate(keys_a):
            if best is not None and i >= sum(best):
                break
            match = where_b.get(key)
            if match is not None and (best is None or i + match < sum(best)):
                best = (i, match)
        row_a, row_b = _row(wa, 0), _row(wb, 0)
        skipped: tuple[int, int] | None = best
        if skipped is None and (wa.num_rows < LOOKAHEAD and wb.num_rows < LOOKAHEAD):
            skipped = (wa.num_rows, wb.num_rows)  # nothing in common up to the end of both files
        detail: dict[str, Any] = {"a": label(row_a), "b": label(row_b)}
        if skipped is not None:
            detail.update(only_in_a=skipped[0], only_in_b=skipped[1])
        else:
            detail["resynchronised_at_step"] = max(row_a["step"], row_b["step"]) + 1
        self.outcome.structural += 1
        if self._other is None:
            at = row_a if skipped is None or skipped[0] else row_b
            self._other = (_divergence(self.rank, at, kind="structural", origin=False, detail=detail),
                           self.a.position)
        if skipped is not None:
            self.a.advance(skipped[0])
            self.b.advance(skipped[1])
        else:
            self.a.skip_to_step(detail["resynchronised_at_step"])
            self.b.skip_to_step(detail["resynchronised_at_step"])

    def _tail(self) -> None:
        """One run (or both) ended: records left on one side mean the other rank ended early."""
        ended, other = (self.a, self.b) if self.a.head() is None else (self.b, self.a)
        head = other.head()
        if head is not None:
            row = _row(head, 0)
            left = other.drain()
            detail = {"ended": "a" if ended is self.a else "b", "last_common_step": row["step"] - 1,
                      "records_left": left, "closed": ended.complete}
        elif self.a.complete != self.b.complete and self._last is not None:
            # Same records, but one rank never closed its trace: it ended after its last flushed batch.
            row = _row(self._last, self._last.num_rows - 1)
            detail = {"ended": "b" if self.a.complete else "a", "last_common_step": row["step"],
                      "records_left": 0, "closed": False}
        elif self.stopped is not None:
            # The common steps matched, and one run stopped (closed its trace) before the other's last step.
            last, first = self.stopped[1], self.stopped[3]
            row = _end_row(self._last, step=max(last, first - 1) + 1)
            detail = {"ended": self.stopped[0].lower(), "last_common_step": max(last, first - 1), "records_left": 0,
                      "closed": True}
        else:
            return
        if self.stopped is not None and detail["closed"] and detail["ended"] == self.stopped[0].lower():
            detail.update(ran_on_to=self.stopped[2], first_step=self.stopped[3])
        if self._other is None:
            self._other = (_divergence(self.rank, row, kind="missing", origin=False, detail=detail),
                           self.a.position)

    # -- the answer -----------------------------------------------------------------------------------------
    def _finish(self) -> RankOutcome:
        self._training_first()
        evaluation = self.outcome.apart.evaluation if self.outcome.apart is not None else None
        first = self.outcome.first
        if evaluation is not None and (first is None or evaluation[0]["seq"] < first.seq):
            # An evaluation both runs ran gave other bits: a divergence of its own (never its absence in one run).
            ra, rb, origin = evaluation
            self.outcome.first = _divergence(self.rank, ra, kind="numeric", origin=origin,
                                             detail={**differences(ra, rb), **self._call(ra)})
            self.outcome.link = None
        final = self.outcome.apart.final if self.outcome.apart is not None else None
        if self.outcome.first is None and final is not None and self.stopped is None:
            # Every step matched and both runs ended at the same one: the state changed after the last step.
            self.outcome.first = _divergence(self.rank, final[0], kind="numeric", origin=True,
                                             detail=differences(*final))
        return self.outcome

    def _training_first(self) -> None:
        """The first divergence of the training's own records (and its link to a collective), in `outcome`."""
        other = self._other
        if self._d1 is None or (other is not None and other[1] <= self._d1[2]):
            self.outcome.first = other[0] if other is not None else None
            return
        d1a, d1b, _ = self._d1
        ra, rb = self._origin or (d1a, d1b)
        detail = differences(ra, rb)
        detail.update(self._call(ra))
        if self._origin is not None and self._origin[0] is not d1a:
            detail["receiver"] = {"label": label(d1a), "step": d1a["step"], "seq": d1a["seq"],
                                  **differences(d1a, d1b)}
        self.outcome.first = _divergence(self.rank, ra, kind="numeric", origin=self._origin is not None,
                                         detail=detail)
        if self._origin is None and ra["phase"] in COMMUNICATION and ra["role"] in OUTPUT_ROLES:
            self.outcome.link = Link(ra["name"], ra["phase"], ra["group"], ra["group_seq"], ra["peer"])

    def _call(self, row: dict[str, Any]) -> dict[str, Any]:
        """The shapes and dtypes of the divergent call's tensors, read back from run A up to the record."""
        inputs: list[str] = []
        outputs: list[str] = []
        event, last = row["event"], row["seq"]
        assert self.a_file is not None  # a numeric divergence has records on both sides
        for batch in self.a_file.stream():
            seqs = batch.column("seq")
            if seqs[-1].as_py() < event:
                continue
            mine = batch.filter(pc.equal(batch.column("event"), event)).select(["role", "shape", "dtype"])
            for record in mine.to_pylist():
                side = inputs if record["role"] in INPUT_ROLES else outputs
                if len(side) < MAX_CALL_TENSORS:
                    side.append(f"{record['role']} {tensor_label(record)}")
            if seqs[0].as_py() > last:
                break
        return {"inputs": inputs, "outputs": outputs}


def _end_row(last: pa.RecordBatch | None, *, step: int) -> dict[str, Any]:
    """The row a run's early stop is reported at: the first step only the other run has, after the last record
    aligned (none when nothing was: a run that trained no step)."""
    row = _row(last, last.num_rows - 1) if last is not None else {"seq": 0, "collectives": 0}
    return {"step": step, "seq": row["seq"], "rung": "metrics", "phase": "other", "name": "(the run's end)",
            "module": None, "role": "output", "occurrence": 0, "index": 0, "event": row["seq"],
            "collectives": row["collectives"]}


def _is_bucket(batch: pa.RecordBatch, i: int) -> bool:
    """Whether record `i` is a DDP bucket reduction (its extra names the bucket)."""
    if i >= batch.num_rows:
        return False
    extra = batch.column("extra")[i].as_py()
    return batch.column("phase")[i].as_py() == "collective" and extra is not None and '"ddp_bucket"' in extra


def _buckets(window: pa.Table) -> list[tuple[tuple[int, tuple[str, ...]], int]]:
    """The DDP bucket reductions at the head of `window` (one backward's, recorded together): per bucket, its
    (index, parameter names) and its number of records."""
    found: list[tuple[tuple[int, tuple[str, ...]], int]] = []
    bucket = pc.and_(pc.equal(window.column("phase"), "collective"),
                     pc.match_substring(window.column("extra"), '"ddp_bucket"'))
    flags = pc.fill_null(bucket, False).to_numpy(zero_copy_only=False)
    leading = len(flags) if flags.all() else int(np.argmin(flags))
    for extra in window.column("extra").slice(0, leading).to_pylist():
        parsed = json.loads(extra)
        layout = (int(parsed["ddp_bucket"]), tuple(parsed.get("params", ())))
        if found and found[-1][0] == layout:
            found[-1] = (layout, found[-1][1] + 1)
        else:
            found.append((layout, 1))
    return found


def _params(buckets: list[tuple[tuple[int, tuple[str, ...]], int]], i: int) -> str:
    if i >= len(buckets):
        return "nothing"
    names = buckets[i][0][1]
    return "[" + ", ".join(names[:4]) + (f", ... {len(names)} in all" if len(names) > 4 else "") + "]"


def align_rank(task: tuple[int, RankFile | None, RankFile | None, int, int | None,
                           tuple[str, int, int, int] | None]) -> RankOutcome:
    """Pool entry point: (rank, its file in run A, in run B (None: no trace there), first and last global step
    compared, the run that stopped early (see RankAligner)) -> outcome."""
    rank, a, b, start, end, stopped = task
    return RankAligner(rank, a, b, steps=(start, end), stopped=stopped).run()
