"""`detrace certify`: the invariants one trace must satisfy before anyone trusts a diff of it.

- every expected rank wrote a trace, and closed it (footer present, no torn tail, footer's count = records read);
- every expected step is present on every expected rank;
- sequence numbers are dense from 0 (no record lost or duplicated);
- no collective or send/recv is left incomplete at the end of a window: an input record without its output
  (the window closed between issue and completion, or the rank died inside the call);
- every rank file's embedded header says what run.json says (command, rung, windows, ranks, world size): a rank
  file of another run swapped in is not this run's;
- every record batch matches its checksum and the chain sealed in the footer (no corrupted byte), and a closed
  rank file still ends in the Arrow file footer that Arrow's file readers need.
Ranks are checked in parallel, each streamed batch by batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from detrace.analyze.apart import APART_PHASES
from detrace.analyze.classify import COMMUNICATION, INPUT_ROLES
from detrace.analyze.pool import default_workers, map_ranks
from detrace.tracefile import RankFile, open_run
from detrace.tracefile.integrity import arrow_footer_checksum, chain_text
from detrace.tracefile.layout import footer_path, run_header_path
from detrace.tracefile.metadata import RunHeader, load_json
from detrace.tracefile.reader import CorruptTrace
from detrace.tracefile.selection import Members, describe_runs, parse_window

RUN_KEYS = ("command", "rung", "windows", "ranks", "world_size")
"""What run.json and every rank file's embedded header say alike (record.header.base_header): a rank file whose
header says otherwise is another run's."""
_COMMUNICATION_SET = pa.array(sorted(COMMUNICATION))
_APART_SET = pa.array(APART_PHASES)


@dataclass(frozen=True, kw_only=True)
class CertifyResult:
    """What certify checked and every violation it found (one sentence each)."""

    run: str
    ranks: Sequence[int]
    """The expected ranks."""
    steps: Sequence[int]
    """The expected steps (a window's members: never materialized, however large the SPEC's ranges)."""
    records: int
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True)
class _RankFacts:
    rank: int
    records: int
    steps: frozenset[int]
    violations: list[str]
    corrupt: bool = False
    """The rank file is corrupted: what follows the corrupted batch is unknown, so nothing is said about it."""
    first_step: int = 0
    """The first global step the rank ran, from its footer (a run resumed after step K starts at K)."""
    header: dict[str, Any] = field(default_factory=dict)
    """The run header embedded in the rank file (what it shares with run.json: `RUN_KEYS`)."""


def _open_call(row: dict[str, Any]) -> str:
    group = f" group {row['group']}" if row["group"] else ""
    peer = f" peer {row['peer']}" if row["peer"] is not None else ""
    return f"{row['name']}#{row['group_seq']}{group}{peer} (seq {row['event']}, step {row['step']})"


def _arrow_footer_problem(path: Path, recorded: str | None) -> str | None:
    """What is wrong with a closed rank file's Arrow IPC file footer (what Arrow's file readers read), or None.
    Its checksum, recorded at close, covers every byte of it; a trace without one gets Arrow's own check."""
    lost = (f"{path.name} lost the end of its Arrow file footer: detrace and pyarrow.ipc.open_stream (after the "
            "file's 8-byte magic) still read every record, but pyarrow.ipc.open_file, pandas.read_feather, Polars "
            "and DuckDB cannot open it")
    if recorded is not None:
        actual = arrow_footer_checksum(path)
        if actual is None:
            return lost
        if chain_text(actual) != recorded:
            return (f"{path.name} in {path.parent} is corrupted in its Arrow file footer (the copy of the header and "
                    "the batch offsets that pyarrow.ipc.open_file, pandas.read_feather, Polars and DuckDB read): its "
                    "bytes do not match its checksum; detrace's own reader still reads every sealed record")
        return None
    try:
        with pa.OSFile(str(path), "rb") as handle:
            pa.ipc.open_file(handle)
    except (pa.ArrowException, OSError):
        return lost
    return None


def check_rank(file: RankFile) -> _RankFacts:
    """Stream one rank file of an opened run and check its own invariants (pool entry point)."""
    rank, stream, footer = file.rank, file.stream(), file.footer
    header = {key: stream.header.raw[key] for key in RUN_KEYS if key in stream.header.raw}
    violations: list[str] = []
    steps: set[int] = set()
    expected_seq = 0
    seq_faults = 0
    records = 0
    open_calls: dict[int, dict[str, Any]] = {}  # event -> its input record, until its output arrives
    corrupt = False
    try:
        for batch in stream:
            if not batch.num_rows:
                continue
            seqs = batch.column("seq").to_numpy()
            batch_steps = batch.column("step").to_numpy()
            previous = np.concatenate(([expected_seq - 1], seqs[:-1]))
            bad = np.flatnonzero(seqs != previous + 1)
            if bad.size:
                if not seq_faults:
                    i = int(bad[0])
                    violations.append(f"rank {rank}: seq is not dense: expected {previous[i] + 1}, "
                                      f"found {seqs[i]} at step {batch_steps[i]}")
                seq_faults += int(bad.size)
            expected_seq = int(seqs[-1]) + 1
            records += batch.num_rows
            steps.update(np.unique(batch_steps).tolist())
            # Collectives recorded apart from the training (a checkpoint's, a framework's bookkeeping) must
            # complete too: they are the calls of those phases that carry a group sequence number.
            phase = batch.column("phase")
            apart = pc.and_(pc.is_in(phase, value_set=_APART_SET), pc.is_valid(batch.column("group_seq")))
            calls = batch.filter(pc.or_(pc.is_in(phase, value_set=_COMMUNICATION_SET), apart))
            for row in calls.select(["event", "step", "name", "role", "group", "group_seq", "peer"]).to_pylist():
                if row["role"] in INPUT_ROLES:
                    open_calls.setdefault(row["event"], row)
                    continue
                opened = open_calls.pop(row["event"], None)
                if opened is not None and any(s not in steps for s in range(opened["step"], row["step"])):
                    violations.append(f"rank {rank}: {_open_call(opened)} completed only at step {row['step']}, "
                                      f"after its step window ended")
    except CorruptTrace as err:
        violations.append(f"rank {rank}: {err}")
        corrupt = True
    if corrupt:  # what follows the corrupted batch is unknown: counting it would only add noise
        return _RankFacts(rank, records, frozenset(steps), violations, corrupt=True, header=header)
    violations += [f"rank {rank}: {_open_call(row)} has its input but no output" for row in open_calls.values()]
    if seq_faults > 1:
        violations.append(f"rank {rank}: the seq order breaks {seq_faults} times in all")
    if stream.torn:
        violations.append(f"rank {rank}: the trace ends in a torn batch (the process died while writing)")
    if footer is not None and footer.rebuilt:
        violations.append(f"rank {rank}: its footer file {footer_path(stream.path.parent, rank).name} is missing (the "
                          "rank closed its trace: its Arrow file was finished, and its records were read from it)")
    if footer is None:
        violations.append(f"rank {rank}: no footer: the rank never closed its trace")
    elif footer.records != records:
        violations.append(f"rank {rank}: the footer counts {footer.records} records, the file holds {records}")
    elif (problem := _arrow_footer_problem(stream.path, footer.arrow_footer)) is not None:
        violations.append(f"rank {rank}: {problem}")
    first_step = footer.first_step if footer is not None and footer.first_step is not None else 0
    return _RankFacts(rank, records, frozenset(steps), violations, first_step=first_step, header=header)


def _foreign(fact: _RankFacts, run_json: dict[str, Any]) -> str | None:
    """The violation of a rank file whose embedded header is not the run's (a file of another run swapped in)."""
    differ = [key for key in RUN_KEYS if key in fact.header and run_json.get(key) is not None
              and fact.header[key] is not None and fact.header[key] != run_json[key]]
    if not differ:
        return None
    shown = "; ".join(f"{key} {_short(fact.header[key])} in the file, {_short(run_json[key])} in run.json"
                      for key in differ)
    return f"rank {fact.rank}: its trace file is not this run's: its header differs from run.json ({shown})"


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _run_json(run: Path) -> dict[str, Any] | None:
    """The launcher's run.json of a run directory (validated when the run was opened), or None without one."""
    try:
        return dict(RunHeader.from_json(load_json(run_header_path(run), "run header"), "run header").raw)
    except FileNotFoundError:
        return None


def recorded_steps(header: RunHeader) -> str:
    """The steps a run recorded at any rung, as a SPEC: the union of its per-rung step windows."""
    windows = (header.windows.steps if header.windows else None) or "all"
    specs = sorted(set(windows.values())) if isinstance(windows, dict) else [windows]
    return "all" if "all" in specs else ",".join(specs)


def certify(run: str | Path, *, expected_ranks: str | None = None, expected_steps: str | None = None,
            workers: int | None = None) -> CertifyResult:
    """Check a run directory's invariants. SPECs default to the windows the run was recorded with (steps: from
    each rank's first global step on, so a resumed run is not missing the steps before its resume).

    Raises TraceError when the directory is missing, empty or unreadable.
    """
    info = open_run(run)
    rank_window = parse_window(expected_ranks or info.header.ranks or "all")
    step_window = parse_window(expected_steps or recorded_steps(info.header))
    ranks = Members(rank_window, None if rank_window.bounded else info.world_size)
    present = [r for r in info.ranks if r in ranks]
    if workers is None:
        workers = default_workers(len(present), sum(info.files[r].path.stat().st_size for r in present))
    facts = map_ranks(check_rank, [info.files[r] for r in present], workers=workers)
    last = max((max(f.steps) for f in facts if f.steps), default=-1)
    steps = Members(step_window, None if step_window.bounded else last + 1)
    absent, runs = rank_window.missing(info.ranks, ranks.upto)
    if absent <= 8 and absent == sum(hi - lo + 1 for lo, hi in runs):  # a few: one sentence each
        violations = [f"rank {r}: no trace file" for lo, hi in runs for r in range(lo, hi + 1)]
    else:
        violations = [f"{absent} expected ranks have no trace file ({describe_runs(absent, runs)})"]
    if next(iter(steps), None) is None:  # not len(): a window's count may not fit an index
        # Certifying no step at all would be vacuous: a window that starts past the run's end says nothing about it.
        held = f"steps 0-{last}" if last >= 0 else "no step"
        violations.append(f"no expected step is in the run: it holds {held}, and the expected steps "
                          f"{step_window.spec} begin after them")
    run_json = _run_json(info.path)
    for fact in facts:
        if run_json is not None and (foreign := _foreign(fact, run_json)) is not None:
            violations.append(foreign)
        # By default a rank owes the steps it ran: a resumed run's first global step is K, not 0.
        start = fact.first_step if expected_steps is None else 0
        missing, runs = step_window.missing(fact.steps, steps.upto, start=start)
        if missing and not fact.corrupt:
            violations.append(f"rank {fact.rank}: {missing} expected steps missing ({describe_runs(missing, runs)})")
        violations += fact.violations
    return CertifyResult(run=str(run), ranks=ranks, steps=steps, records=sum(f.records for f in facts),
                         violations=violations)
