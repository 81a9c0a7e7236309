"""`detrace.diff(a, b)`: open both runs, refuse incomparable ones, align every rank on the global steps both runs
have, order the results causally.

Steps are global (optimizer steps since the training began, across restarts): a run resumed after step K holds
steps K and up, and is compared with the steps K and up of a run that never stopped. Each rank's footer says which
steps it ran (`steps`: the first step run, the first and last step holding records, the source of the numbering);
a trace without one (a rank that was killed) is read for them. Records before the later of the two first steps
are skipped; records after the earlier of the two last steps are not aligned when the shorter run closed its trace
(it stopped there), and when it did not (it died), the rest is a "missing" divergence as before.

Every step is accounted for: a run that starts later (resumed) is compared from where it starts, but one that ends
earlier, or trains no step at all, is never "identical" to one that ran on. When the overlap is equal, the shorter
run's stop is the divergence (kind "missing", detail "ran_on_to": the other run's last step), in one sentence
naming which run stopped where (`Divergence.stop`).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.analyze import apart
from detrace.analyze.align import align_rank
from detrace.analyze.causality import resolve
from detrace.analyze.diff_result import Compared, DiffResult
from detrace.analyze.pool import default_workers, map_ranks
from detrace.errors import UsageError
from detrace.tracefile import RankFile, RunInfo, open_run
from detrace.tracefile.layout import footer_path
from detrace.tracefile.lock import dead_writer
from detrace.verdicts import DiffVerdict


@dataclass(frozen=True)
class StepSpan:
    """The global steps of one rank's trace."""

    first: int
    """The first step the process ran (a resumed run: the step it resumed at)."""
    last: int
    """The last step holding records (-1: none)."""
    source: str | None
    """Where the numbering came from ("process": counted from the process's start; None: not recorded)."""
    closed: bool
    """The rank closed its trace: it stopped after `last` rather than dying there."""

    @property
    def resumed(self) -> bool:
        return self.source not in (None, "process") and self.first > 0


def _running(path: Path) -> str:
    """What a run whose run.json says "running" is: still written, or left so by a writer that died."""
    dead = dead_writer(path)
    if dead is None:
        return f"{path} is still running (its run.json says so): its trace may not be complete yet"
    return (f"{path}'s run.json says \"running\", but the detrace run that wrote it died ({dead}): it was killed, "
            "and its trace ends where it stopped")


def step_span(file: RankFile) -> StepSpan:
    """A rank's global steps: from its footer (the tracer's `steps`, the writer's `last_step`), and from its
    records for what the footer lacks (the first batch for the first step; every batch for the last step of a
    rank that was killed before it wrote a footer)."""
    footer = file.footer
    steps = footer.steps if footer is not None else None
    source = steps.source if steps is not None else None
    first = steps.first if steps is not None else None
    last = footer.last_step if footer is not None else None
    if first is None or last is None:
        seen = None
        stream = file.stream()
        for batch in stream:
            if batch.num_rows:
                column = batch.column("step")
                first = column[0].as_py() if first is None else first
                if last is not None:
                    break  # only the first step was missing
                seen = column[-1].as_py()
        stream.close()
        last = seen if last is None else last
    return StepSpan(first=first or 0, last=-1 if last is None else last, source=source, closed=footer is not None)


def common_steps(a: StepSpan, b: StepSpan) -> tuple[int, int, int | None] | None:
    """(first, last, end) of the steps two ranks share, or None when they share none. `end` is where alignment
    stops: the last shared step when the shorter run closed its trace there, else None (its end is a divergence:
    a run that died before the other's first step is compared from there and is missing)."""
    first, last = max(a.first, b.first), min(a.last, b.last)
    shorter, longer = (a, b) if a.last < b.last else (b, a)
    if last < first:
        if shorter.closed and shorter.last < shorter.first <= longer.last:
            # It trained no step from its own first on (a resumed epoch loop that overshoots): nothing is aligned,
            # and that it stopped before the other's steps is the divergence.
            return shorter.first, shorter.first, shorter.first - 1
        # A rank that died before the other's first step is missing there; two that closed share nothing.
        return None if shorter.closed else (first, first, None)
    end = last if a.last != b.last and shorter.closed else None
    return first, last, end


def stopped_early(a: StepSpan, b: StepSpan) -> tuple[str, int, int, int] | None:
    """("A" or "B", its last step, the other's last step, its first step) when one rank closed its trace (it
    stopped, it did not die) before the other's last step; None when both ran to the same step or the shorter one
    died (the diff's "missing" divergence says that)."""
    if a.last == b.last:
        return None
    name, shorter, longer = ("A", a, b) if a.last < b.last else ("B", b, a)
    return (name, shorter.last, longer.last, shorter.first) if shorter.closed else None


def describe_steps(first: int, last: int, a: StepSpan, b: StepSpan) -> str | None:
    """"compared global steps 4-7 (B resumed after step 4)"; None when both runs hold the same steps."""
    notes = []
    for name, span, other in (("A", a, b), ("B", b, a)):
        if span.first > other.first:
            notes.append(f"{name} resumed after step {span.first}" if span.resumed
                         else f"{name}'s trace starts at step {span.first}")
    for name, span, other in (("A", a, b), ("B", b, a)):
        if span.last > other.last:
            notes.append(f"{name} ran on to step {span.last}")
    if not notes:
        return None
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"compared global {steps} ({'; '.join(notes)})"


def _command_difference(a: list[str], b: list[str]) -> str:
    """"A ran `... --augment` and B ran `... --augment --resume`": the arguments where two commands differ, with
    one argument of context on each side."""
    head = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    tail = next((i for i, (x, y) in enumerate(zip(a[::-1], b[::-1], strict=False)) if x != y or i >= len(a) - head
                 or i >= len(b) - head), 0)
    lo = max(head - 1, 0)

    def part(command: list[str]) -> str:
        hi = min(len(command) - tail + 1, len(command))
        text = shlex.join(command[lo:hi])
        return ("... " if lo else "") + _short(text) + (" ..." if hi < len(command) else "")

    return f"A ran `{part(a)}` and B ran `{part(b)}`"


def _command(run: RunInfo) -> list[str] | None:
    return list(run.header.command) or None


def _facts(run: RunInfo) -> dict[str, Any]:
    """What must agree for two runs to be comparable record by record, by how a sentence names it."""
    header, windows = run.header, run.header.windows
    return {"trace schema": header.schema, "fingerprint scheme": header.fingerprint, "rung": header.rung,
            "step windows": windows.steps if windows else None,
            "rank window": windows.ranks if windows and windows.ranks is not None else header.ranks,
            "--max-numel": windows.max_numel if windows else None}


def _layout(run: RunInfo, rank: int) -> tuple[str, ...] | None:
    """The process groups a rank used (its footer's "groups"): the parallel layout as the trace saw it."""
    footer = run.files[rank].footer
    return footer.groups if footer is not None else None


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


def diff(a: str | Path, b: str | Path, *, rank: int | None = None, workers: int | None = None,
         strict_command: bool = False, command_differs: bool = False) -> DiffResult:
    """Compare two run directories on the global steps both have and return where, if anywhere, their bits first
    differ.

    `rank` restricts the comparison to one rank. `workers` processes align ranks in parallel (default: every
    core when the runs are large enough to gain from it). Runs of different commands are compared (and the
    result says so) unless `strict_command`; `command_differs`: the caller gave B other arguments on purpose
    (check-resume's --resume-args), so the result does not note it, which would read like a cause. Raises
    TraceError for a missing, empty or unreadable run directory;
    returns verdict "incomparable" for runs of different world sizes, schemas or layouts, or with no global step
    in common.
    """
    run_a, run_b = open_run(a), open_run(b)
    reason = incomparable(run_a, run_b)
    notes = []
    command_a, command_b = _command(run_a), _command(run_b)
    if command_a is not None and command_b is not None and command_a != command_b and not command_differs:
        said = _command_difference(command_a, command_b)
        if strict_command and reason is None:
            reason = f"the runs are of different commands: {said} (--strict-command)."
        notes.append(f"the runs are of different commands: {said}")
    # A trace still being written may yet grow (or end torn): whatever the verdict, it is of the records so far.
    notes += [_running(run.path) for run in (run_a, run_b) if run.header.status == "running"]
    notes += [f"{run.path}: the footer file of rank {r} ({footer_path(run.path, r).name}) is missing; the rank "
              "closed its trace (its Arrow file was finished), so what the footer said was read from its records"
              for run in (run_a, run_b) for r, file in run.files.items() if file.footer and file.footer.rebuilt]
    if reason is not None:
        return DiffResult(verdict="incomparable", reason=reason, a=str(a), b=str(b), notes=notes)
    ranks = sorted(set(run_a.ranks) | set(run_b.ranks))
    if rank is not None:
        if rank not in ranks:
            raise UsageError(f"rank {rank} has no trace in {a} or {b} (ranks traced: {_ranks(ranks)})")
        ranks = [rank]
    spans: dict[int, tuple[int, int, int | None]] = {}
    stops: dict[int, tuple[str, int, int, int]] = {}
    """Rank -> (the run that stopped early, its last step, the other's last step, its first step)."""
    described = None
    unclosed: dict[str, dict[int, int]] = {"A": {}, "B": {}}
    for r in ranks:
        if r not in run_a.ranks or r not in run_b.ranks:
            continue
        span_a, span_b = step_span(run_a.files[r]), step_span(run_b.files[r])
        for name, span in (("A", span_a), ("B", span_b)):
            if not span.closed:
                unclosed[name][r] = span.last
        common = common_steps(span_a, span_b)
        if common is None:
            return DiffResult(verdict="incomparable", a=str(a), b=str(b), notes=notes, reason=(
                f"the runs have no global step in common: rank {r} of {a} holds {_steps(span_a)} and of {b} "
                f"{_steps(span_b)}."))
        spans[r] = common
        described = described or describe_steps(common[0], common[1], span_a, span_b)
        if (early := stopped_early(span_a, span_b)) is not None:
            stops[r] = early
    start = min((s[0] for s in spans.values()), default=0)
    tasks = [(r, run_a.files.get(r), run_b.files.get(r), *(spans[r][::2] if r in spans else (0, None)), stops.get(r))
             for r in ranks]
    if workers is not None and workers < 1:
        raise UsageError(f"workers must be at least 1, not {workers}")
    if workers is None:
        size = sum(run.files[r].path.stat().st_size for r in ranks for run in (run_a, run_b) if r in run.files)
        workers = default_workers(len(tasks), size)
    outcomes = map_ranks(align_rank, tasks, workers=workers)
    notes += [o.layout for o in outcomes if o.layout is not None]
    set_aside = apart.note({o.rank: o.apart for o in outcomes if o.apart is not None})
    if set_aside is not None:
        notes.append(set_aside)
    results, origin_ranks, first = resolve(outcomes)
    verdict: DiffVerdict = "diverged" if first is not None else "identical"
    notes += [unclosed_note(name, ends) for name, ends in unclosed.items() if ends]
    steps = (start, max(s[1] for s in spans.values())) if spans else None
    return DiffResult(verdict=verdict, first=first, origin_ranks=origin_ranks, ranks=results,
                      compared=Compared(len(results), sum(r.records for r in results),
                                        sum(r.unverified for r in results), steps),
                      a=str(a), b=str(b), steps=described, notes=notes,
                      unclosed=[name for name, ends in unclosed.items() if ends])


def unclosed_note(name: str, ends: dict[int, int]) -> str:
    """"A's trace ends inside a step: ..." for the ranks of run `name` that never closed their trace, by the last
    step each recorded."""
    where = ", ".join(f"rank {rank} in step {step}" for rank, step in sorted(ends.items())[:4])
    more = f" and {len(ends) - 4} more ranks" if len(ends) > 4 else ""
    return (f"{name}'s trace ends inside a step ({where}{more}): the process never closed its trace (os._exit, a "
            "signal or a hard crash), so that step may be cut short and what ran after it was not recorded")


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")


def _steps(span: StepSpan) -> str:
    if span.last < 0:
        return "no record"
    return f"global step {span.first}" if span.first >= span.last else f"global steps {span.first}-{span.last}"
