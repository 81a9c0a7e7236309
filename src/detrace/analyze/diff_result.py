"""The typed result of a diff and its JSON form, schema "detrace.diff/1" (an example is in docs/diff.md).

The JSON carries exactly the keys of the schema. The Python objects carry a little more that the JSON does not
(the occurrence counter and index of the divergent record, its collective counter, a `detail` dict and per-rank
counts), because `detrace locate` needs the occurrence to capture an op and the terminal report shows the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from detrace.verdicts import DIFF, DiffVerdict

SCHEMA = "detrace.diff/1"

Kind = Literal["numeric", "structural", "missing"]
Cause = Literal["origin", "receiver", "identical", "missing"]


TOP_LEVEL = "(top level)"
"""How every report names module "": code in the root model's own forward, or outside every module (the loop)."""


def scope_label(module: str | None) -> str:
    """A record's module as every report names it: its qualified name, or TOP_LEVEL."""
    return module or TOP_LEVEL


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first record of one rank where two runs differ."""

    rank: int
    """The rank the record belongs to."""
    step: int
    """Training step of the record."""
    seq: int
    """Sequence number in run A's rank trace (in run B's when the record exists only there)."""
    rung: str
    """metrics | semantic | module | op."""
    phase: str
    """forward | backward | optimizer | collective | p2p | recompute | data | checkpoint | bookkeeping | evaluation |
    other."""
    kind: Kind
    """numeric (same identity, different bits), structural (the sequence of calls changed), missing (a run ended)."""
    name: str
    """Op, module, collective or metric name."""
    module: str | None
    """Innermost nn.Module qualified name in scope, if any."""
    role: str
    """Role of the record in its call: output, input, grad_input, param, metric..."""
    origin: bool
    """The call's inputs were equal and its output differs: this call made the difference."""
    occurrence: int = 0
    """How many calls with this (phase, module, name) came before it in its step (identifies the call)."""
    index: int = 0
    """Position of the tensor among the call's tensors of that role."""
    event: int = 0
    """Run A's seq of the first record of the call (records of one call share it)."""
    collectives: int = 0
    """Collectives completed on this rank before this record: orders divergences across ranks."""
    detail: dict[str, Any] = field(default_factory=dict)
    """What differs: digests, differing chunk indices, the call's input/output shapes and dtypes, the receiver
    record found before the origin, the last common step of a missing rank."""

    def to_json(self) -> dict[str, Any]:
        """The `first` object of the schema."""
        return {"rank": self.rank, "step": self.step, "seq": self.seq, "rung": self.rung, "phase": self.phase,
                "kind": self.kind, "name": self.name, "module": self.module, "role": self.role,
                "origin": self.origin}

    @property
    def stop(self) -> str | None:
        """"B stopped after global step 4 and A ran on to step 6: ..." when this divergence is a run that closed its
        trace before the other's last step (detail "ran_on_to"); None for any other."""
        if self.kind != "missing" or "ran_on_to" not in self.detail:
            return None
        name = self.detail["ended"].upper()
        theirs = "A" if name == "B" else "B"
        last, first = self.detail["last_common_step"], self.detail["first_step"]
        stop = (f"{name} trained no step (it began at global step {first} and stopped there)" if last < first
                else f"{name} stopped after global step {last}")
        return (f"{stop} and {theirs} ran on to step {self.detail['ran_on_to']}: the runs do not cover the same "
                "steps, so they are not the same run")

    @property
    def scope(self) -> str | None:
        """The module as a reader names it (`scope_label`); None when no module was in scope."""
        return None if self.module is None else scope_label(self.module)

    @property
    def order(self) -> tuple[int, int, int, int]:
        """Sort key across ranks: step, then the collective counter (a causal clock), then rank and seq."""
        return (self.step, self.collectives, self.rank, self.seq)


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """One rank's verdict: its first divergence and how the divergence got there."""

    rank: int
    first: Divergence | None
    """The first divergence in this rank's execution order (the origin, when walking back found one)."""
    cause: Cause
    """origin: the divergence arose on this rank; receiver: it arrived through a collective or send/recv."""
    via: str | None = None
    """For receivers: the collective that brought it, e.g. "all_reduce#3 group 0,1"."""
    records: int = 0
    """Records aligned (present in both runs) on this rank."""
    numeric: int = 0
    """Aligned records whose bits differ."""
    structural: int = 0
    """Places where the sequence of records differs (each resynchronised)."""
    unverified: int = 0
    """Aligned records with no digest to compare in one run or both (above --max-numel, or unfingerprintable):
    they count as equal, since there is nothing to compare, and are reported so that nobody takes them as proven."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "first": self.first.to_json() if self.first else None, "cause": self.cause,
                "via": self.via}


class Compared(NamedTuple):
    """How much was compared."""

    ranks: int
    records: int
    unverified: int = 0
    """Of `records`, those without a digest in one run or both (see RankResult.unverified)."""
    steps: tuple[int, int] | None = None
    """The first and last global step compared (the steps both runs have); None when nothing was compared."""


@dataclass(frozen=True, kw_only=True)
class DiffResult:
    """The answer of `detrace.diff(a, b)`."""

    verdict: DiffVerdict
    reason: str | None = None
    """Why the runs are incomparable (one sentence), else None."""
    first: Divergence | None = None
    """The first divergence across ranks: on the earliest origin rank when there is one."""
    origin_ranks: list[int] = field(default_factory=list)
    """Ranks where the divergence arose (not received through a collective), in causal order."""
    ranks: list[RankResult] = field(default_factory=list)
    compared: Compared = field(default_factory=lambda: Compared(0, 0))
    a: str = ""
    """Run directory A."""
    b: str = ""
    """Run directory B."""
    steps: str | None = None
    """The compared global steps in words: "compared global steps 4-7 (B resumed after step 4)"."""
    notes: list[str] = field(default_factory=list)
    """What the reader should know beside the verdict (e.g. the runs are of different commands)."""
    unclosed: list[str] = field(default_factory=list)
    """The runs ("A", "B") whose trace ends inside a step: a rank never closed it (os._exit, a signal). In the
    JSON it is a note."""

    def to_json(self) -> dict[str, Any]:
        """The `--json` object of `detrace diff`, schema "detrace.diff/1"."""
        return {"schema": SCHEMA, "verdict": self.verdict, "reason": self.reason,
                "first": self.first.to_json() if self.first else None, "origin_ranks": list(self.origin_ranks),
                "ranks": [r.to_json() for r in self.ranks],
                "compared": {"ranks": self.compared.ranks, "records": self.compared.records,
                             "unverified": self.compared.unverified,
                             "steps": None if self.compared.steps is None else
                             {"first": self.compared.steps[0], "last": self.compared.steps[1]}},
                "notes": list(self.notes)}

    @property
    def exit_code(self) -> int:
        """0 identical, 1 diverged, 2 incomparable."""
        return DIFF[self.verdict]


def first_divergent_step(result: DiffResult) -> int | None:
    """The earliest step at which any rank diverges (None when identical or incomparable).

    `detrace locate` uses it on a diff of two metrics+semantic traces to choose the step window of the next rung.
    """
    steps = [r.first.step for r in result.ranks if r.first is not None]
    return min(steps) if steps else None


def first_origin(result: DiffResult) -> Divergence | None:
    """The first record-level origin (inputs equal, output differs) on an origin rank, in causal order.

    On a diff of two op-rung traces this is the op to capture: its step, phase, module, name and occurrence.
    """
    candidates = [r.first for r in result.ranks
                  if r.rank in result.origin_ranks and r.first is not None and r.first.origin]
    return min(candidates, key=lambda d: d.order) if candidates else None
