"""The ladder's records while it runs: a stage (one rung) and a run of CMD as they happen, the answer being settled,
the progress the caller is told, and the error of a run that failed. `detrace.analyze.locate_result` holds their
final records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from detrace.analyze.locate_result import CallRecord, Finding, RunCost, Rung, Stage
from detrace.analyze.replay_result import ReplayResult
from detrace.errors import CommandFailed
from detrace.verdicts import LocateVerdict


class RunFailed(CommandFailed):
    """CMD crashed or hung during one run of the ladder; carries the end of its output."""

    def __init__(self, message: str, output_tail: str = "") -> None:
        super().__init__(message)
        self.output_tail = output_tail


@dataclass(kw_only=True)
class StageRun:
    """One rung of the ladder while it runs (`Stage` is its record)."""

    rung: Rung
    steps: str
    """The steps this rung records in detail."""
    ranks: str
    runs: list[str] = field(default_factory=list)
    """Run directories, in the order they ran (pairs: a, b; a retried pair: c, d)."""
    diff: dict[str, Any] | None = None
    """The `detrace.diff/1` object of this rung's last pair (kernel rung: none)."""
    found: Finding | None = None
    """The divergence this rung settled on."""
    note: str = ""
    """What the rung established, in one sentence."""
    wide: bool = False
    """Record every step, not only steps 0..S: set for the retry of a pair that did not part by step S."""
    start: int = 0
    """The global step this stage's runs start at: 0 (from the beginning), or the checkpoint they resume from."""
    resume_from: str | None = None
    """The checkpoint version its runs resume from (DETRACE_RESUME_FROM); None: they start at step 0."""

    def record(self) -> Stage:
        return Stage(rung=self.rung, steps=self.steps, ranks=self.ranks, runs=tuple(self.runs), diff=self.diff,
                     found=self.found, note=self.note, start=self.start)


class SpentRun(NamedTuple):
    """One run of CMD as it ran (`RunCost` is its record, once the broad rung's step count is known)."""

    run: str
    rung: str
    start: int
    stop: int | None
    """DETRACE_STOP_AT: it stopped once this many steps had completed; None: it ran to its end."""
    seconds: float

    def record(self, total: int) -> RunCost:
        """With `total`, the steps a full run executes (the broad rung's count)."""
        end = total if self.stop is None else min(self.stop, total)
        return RunCost(run=self.run, rung=self.rung, start=self.start, steps=max(0, end - self.start),
                       seconds=self.seconds)


@dataclass(kw_only=True)
class Answer:
    """What `Ladder._ladder` settles, before it becomes a `LocateResult`."""

    verdict: LocateVerdict = "inconclusive"
    message: str = ""
    steps: int = 0
    culprit: Finding | None = None
    culprit_records: list[CallRecord] = field(default_factory=list)
    replay: ReplayResult | None = None


class Progress:
    """What the ladder tells its caller while it works; the CLI renders it with rich, the API stays silent."""

    def run_started(self, name: str, planned: int) -> None:
        """A run of CMD begins; `planned` is the number of runs the ladder now expects in total."""

    def run_finished(self, name: str, elapsed: float) -> None:
        """That run ended (successfully)."""

    def rung(self, stage: Stage) -> None:
        """A rung reached its conclusion (`stage.note`)."""
