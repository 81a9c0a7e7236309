"""The ladder's result as records: what `detrace locate` writes (ladder.json, locate.json) and `detrace report`
reads back.

Every record is a frozen dataclass. `to_json` writes exactly the keys of its schema ("detrace.ladder/1"; the
locate.json object "detrace.locate/1" is `LocateResult.summary()`); `from_json` validates what a file holds and
refuses a malformed one with one sentence naming the file and the field (`detrace.errors.TraceError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from detrace.analyze import Divergence
from detrace.analyze.replay_result import ReplayResult
from detrace.errors import TraceError
from detrace.tracefile.metadata import Fields
from detrace.verdicts import LOCATE, LocateVerdict

LOCATE_SCHEMA = "detrace.locate/1"
LADDER_SCHEMA = "detrace.ladder/1"
LOCATE_FILE = "locate.json"
"""The `detrace.locate/1` object, as `detrace locate --json` prints it."""
LADDER_FILE = "ladder.json"
"""Everything the rungs established (stages, diffs, the culprit's records, every replay arm): the report's input."""

Rung = Literal["semantic", "resume", "module", "op", "kernel"]
"""A stage of the ladder: the broad semantic pair, the proof that resuming is exact, then ever narrower rungs."""
ResumeUse = Literal["no-contract", "unused", "exact", "inexact"]
"""How the ladder used checkpoints: no-contract (CMD wrote none: every run is a full run), unused (no narrow run
needed one), exact (proven: narrow runs resumed), inexact (the proof failed: narrow runs are full runs)."""



@dataclass(frozen=True, kw_only=True)
class Finding:
    """A divergence as ladder.json keeps it: the diff's `first` object plus the call's identity and detail."""

    rank: int
    """The rank the record belongs to."""
    step: int
    """Training step of the record."""
    seq: int
    """Sequence number in run A's rank trace."""
    rung: str
    """The rung that recorded it: metrics | semantic | module | op."""
    phase: str
    """forward | backward | optimizer | collective | p2p | recompute | data | other."""
    kind: str
    """numeric | structural | missing."""
    name: str
    """Op, module, collective or metric name."""
    module: str | None
    """Innermost nn.Module qualified name in scope, if any."""
    role: str
    """Role of the record in its call: output, input, grad_input, param, metric..."""
    origin: bool
    """The call's inputs were equal and its output differs: this call made the difference."""
    occurrence: int
    """How many calls with this (phase, module, name) came before it in its step: identifies the call."""
    index: int
    """Position of the tensor among the call's tensors of that role."""
    event: int
    """Run A's seq of the call's first record."""
    detail: dict[str, Any]
    """What differs (the diff's `Divergence.detail`, as JSON)."""

    @classmethod
    def of(cls, d: Divergence) -> Finding:
        return cls(rank=d.rank, step=d.step, seq=d.seq, rung=d.rung, phase=d.phase, kind=d.kind, name=d.name,
                   module=d.module, role=d.role, origin=d.origin, occurrence=d.occurrence, index=d.index,
                   event=d.event, detail=json.loads(json.dumps(d.detail, default=str)))

    def where(self) -> str:
        """In words: "step 3, rank 0: backward aten.index_put_ in gather (output)"."""
        return (f"step {self.step}, rank {self.rank}: {self.phase} {self.name}"
                + (f" in {self.module}" if self.module else "") + f" ({self.role})")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "seq": self.seq, "rung": self.rung, "phase": self.phase,
                "kind": self.kind, "name": self.name, "module": self.module, "role": self.role,
                "origin": self.origin, "occurrence": self.occurrence, "index": self.index, "event": self.event,
                "detail": self.detail}

    def culprit_json(self) -> dict[str, Any]:
        """The `culprit` object of locate.json."""
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "module": self.module, "name": self.name,
                "origin": self.origin}

    @classmethod
    def from_json(cls, raw: object, source: str) -> Finding:
        f = Fields(raw, source)
        text = "a string"
        return cls(rank=f.count("rank"), step=f.count("step"), seq=f.count("seq"), rung=f.get("rung", str, text),
                   phase=f.get("phase", str, text), kind=f.get("kind", str, text), name=f.get("name", str, text),
                   module=f.get("module", str, text, default=None), role=f.get("role", str, text),
                   origin=f.get("origin", bool, "true or false"), occurrence=f.count("occurrence"),
                   index=f.count("index"), event=f.count("event"), detail=f.get("detail", dict, "an object"))


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One record of the culprit call, in both op-rung runs side by side."""

    role: str
    """input | mutated | output | ..."""
    index: int
    """Position among the call's tensors of that role."""
    shape: list[int] | None
    """The tensor's shape (None: not a tensor)."""
    dtype: str | None
    """Its dtype, as torch names it without the prefix ("float32")."""
    numel: int | None
    """Its number of elements."""
    equal: bool
    """Both runs recorded it with the same shape and digest."""

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "index": self.index, "shape": self.shape, "dtype": self.dtype,
                "numel": self.numel, "equal": self.equal}

    @classmethod
    def from_json(cls, raw: object, source: str) -> CallRecord:
        f = Fields(raw, source)
        shape = f.get("shape", list, "a list of sizes", default=None)
        if shape is not None and not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise f.fail("shape", "a list of sizes")
        return cls(role=f.get("role", str, "a string"), index=f.count("index"), shape=shape,
                   dtype=f.get("dtype", str, "a string", default=None), numel=f.count("numel", default=None),
                   equal=f.get("equal", bool, "true or false"))


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One rung of the ladder as it ran."""

    rung: Rung
    """Which rung (see `Rung`)."""
    steps: str
    """The steps this rung recorded in detail: "all", or the step S it narrowed to."""
    ranks: str
    """The ranks it recorded: "all", or a rank SPEC."""
    runs: tuple[str, ...]
    """Run directories, in the order they ran (pairs: a, b; a retried pair: c, d)."""
    diff: dict[str, Any] | None
    """The `detrace.diff/1` object of this rung's last pair (resume and kernel rungs: none)."""
    found: Finding | None
    """The divergence this rung settled on."""
    note: str
    """What the rung established, in one sentence."""
    start: int = 0
    """The global step its runs started at: 0, or the checkpoint they resumed from."""

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "steps": self.steps, "ranks": self.ranks, "runs": list(self.runs),
                "diff": self.diff, "found": None if self.found is None else self.found.to_json(), "note": self.note,
                "start": self.start}

    @classmethod
    def from_json(cls, raw: object, source: str) -> Stage:
        f = Fields(raw, source)
        found = f.get("found", dict, "an object", default=None)
        return cls(rung=f.choice("rung", get_args(Rung)), steps=f.get("steps", str, "a string"),
                   ranks=f.get("ranks", str, "a string"), runs=tuple(f.strings("runs")),
                   diff=f.get("diff", dict, "an object", default=None),
                   found=None if found is None else Finding.from_json(found, f"{source} (field 'found')"),
                   note=f.get("note", str, "a string"), start=f.count("start", default=0))


@dataclass(frozen=True, kw_only=True)
class RunCost:
    """What one run of CMD cost."""

    run: str
    """Its directory name under `out`."""
    rung: str
    """The rung it recorded."""
    start: int
    """The global step it started at (0, or the checkpoint it resumed from)."""
    steps: int
    """Steps it executed."""
    seconds: float
    """Wall time of the process."""

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "rung": self.rung, "start": self.start, "steps": self.steps,
                "seconds": round(self.seconds, 3)}

    @classmethod
    def from_json(cls, raw: object, source: str) -> RunCost:
        f = Fields(raw, source)
        return cls(run=f.get("run", str, "a string"), rung=f.get("rung", str, "a string"), start=f.count("start"),
                   steps=f.count("steps"), seconds=f.get("seconds", (int, float), "a number of seconds"))


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What the ladder cost: every run of CMD in the order they ran, and the checkpoints it used."""

    per_run: tuple[RunCost, ...]
    """Every run of CMD, in the order they ran."""
    seconds: float
    """Wall time of all runs together."""
    checkpoint_every: int | None
    """K of the checkpointed ladder; None when CMD wrote no checkpoint (it does not follow the contract)."""
    resume: ResumeUse
    """How the ladder used checkpoints (see `ResumeUse`)."""

    @property
    def steps(self) -> int:
        """Steps executed over all runs."""
        return sum(r.steps for r in self.per_run)

    def to_json(self) -> dict[str, Any]:
        return {"runs": len(self.per_run), "steps": self.steps, "seconds": round(self.seconds, 3),
                "checkpoint_every": self.checkpoint_every, "resume": self.resume,
                "per_run": [r.to_json() for r in self.per_run]}

    @classmethod
    def from_json(cls, raw: object, source: str) -> Cost:
        f = Fields(raw, source)
        per_run = f.get("per_run", list, "a list of runs")
        return cls(per_run=tuple(RunCost.from_json(r, f"{source} (per_run[{i}])") for i, r in enumerate(per_run)),
                   seconds=f.get("seconds", (int, float), "a number of seconds"),
                   checkpoint_every=f.count("checkpoint_every", default=None, least=1),
                   resume=f.choice("resume", get_args(ResumeUse)))


@dataclass(frozen=True, kw_only=True)
class LocateResult:
    """What the ladder found: ladder.json (`to_json`), and the locate.json answer (`summary`)."""

    verdict: LocateVerdict
    """deterministic | nondeterministic (a culprit was found) | inconclusive (a rung could not settle)."""
    message: str
    """The one-sentence answer."""
    command: tuple[str, ...]
    """CMD."""
    out: Path
    """The locate directory."""
    steps: int
    """Steps the broad rung recorded."""
    culprit: Finding | None
    """The narrowest divergence found."""
    culprit_records: tuple[CallRecord, ...]
    """The culprit call's records in both op-rung runs."""
    replay: ReplayResult | None
    """The kernel rung's replay of the culprit."""
    stages: tuple[Stage, ...]
    """Every rung as it ran, in order."""
    report: str
    """The HTML report's path ("" before it is written)."""
    notes: tuple[str, ...]
    """What the summary adds: a CMD without the resume contract, or a resume that was not exact."""
    cost: Cost | None
    """What the ladder cost (None: read from a ladder.json written before the ladder counted it)."""

    @property
    def runs(self) -> list[str]:
        return [run for stage in self.stages for run in stage.runs]

    @property
    def exit_code(self) -> int:
        return LOCATE[self.verdict]

    def summary(self) -> dict[str, Any]:
        """The `detrace.locate/1` object (docs/locate.md shows one), with the ladder's cost."""
        return {"schema": LOCATE_SCHEMA, "verdict": self.verdict,
                "culprit": None if self.culprit is None else self.culprit.culprit_json(),
                "replay": None if self.replay is None else self.replay.summary(),
                "runs": self.runs, "report": self.report, "cost": None if self.cost is None else self.cost.to_json()}

    def to_json(self) -> dict[str, Any]:
        """`detrace.ladder/1`: everything `detrace report` draws."""
        return {"schema": LADDER_SCHEMA, "verdict": self.verdict, "message": self.message,
                "command": list(self.command), "steps": self.steps,
                "culprit": None if self.culprit is None else self.culprit.to_json(),
                "culprit_records": [r.to_json() for r in self.culprit_records],
                "replay": None if self.replay is None else self.replay.to_json(),
                "stages": [s.to_json() for s in self.stages], "runs": self.runs, "report": self.report,
                "notes": list(self.notes), "cost": None if self.cost is None else self.cost.to_json()}

    @classmethod
    def from_json(cls, raw: object, source: str, *, out: Path) -> LocateResult:
        """A ladder.json object read back; `out` is the directory it was read from. Files written before the
        ladder kept notes, costs and stage starts (same schema) read as none, none and 0."""
        f = Fields(raw, source)
        if f.get("schema", str, "a string") != LADDER_SCHEMA:
            raise TraceError(f"{source} has schema {f.raw['schema']!r}; this detrace reads {LADDER_SCHEMA}")
        culprit = f.get("culprit", dict, "an object", default=None)
        replay = f.get("replay", dict, "an object", default=None)
        cost = f.get("cost", dict, "an object", default=None)
        return cls(verdict=f.choice("verdict", get_args(LocateVerdict)), message=f.get("message", str, "a string"),
                   command=tuple(f.strings("command")), out=out, steps=f.count("steps"),
                   culprit=None if culprit is None else Finding.from_json(culprit, f"{source} (field 'culprit')"),
                   culprit_records=tuple(CallRecord.from_json(r, f"{source} (culprit_records[{i}])")
                                         for i, r in enumerate(f.get("culprit_records", list, "a list"))),
                   replay=None if replay is None else ReplayResult.from_json(replay, f"{source} (field 'replay')"),
                   stages=tuple(Stage.from_json(s, f"{source} (stages[{i}])")
                                for i, s in enumerate(f.get("stages", list, "a list of stages"))),
                   report=f.get("report", str, "a string"), notes=tuple(f.strings("notes", default=[])),
                   cost=None if cost is None else Cost.from_json(cost, f"{source} (field 'cost')"))


def load_ladder(out: str | Path) -> LocateResult:
    """Read a locate directory's ladder.json."""
    path = Path(out) / LADDER_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{out} is not a locate directory (no {LADDER_FILE})") from None
    except (OSError, ValueError) as err:
        raise TraceError(f"{path} is unreadable: {err}") from None
    return LocateResult.from_json(data, str(path), out=Path(out))
