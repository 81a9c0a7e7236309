"""The audit's records: one hazard (what, where, how sure, what fixes it) and the report of a whole run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from detrace.errors import TraceError

SCHEMA: Final = "detrace.audit/1"
"""The schema of `detrace audit --json` and of the per-rank files the probe writes."""
ENV_AUDIT: Final = "DETRACE_AUDIT"
"""Set by `detrace audit` (and for `detrace locate`'s first run) to the number of steps to audit: the tracer arms
the probe (`detrace.investigate.audit.probe`) in every process where it is set."""
AUDIT_DIR: Final = "audit"
"""The folder of a run directory that holds the probe's files."""


def rank_file(out: Path, rank: int) -> Path:
    """Where one rank's probe writes its hazards."""
    return Path(out) / AUDIT_DIR / f"rank-{rank}.json"

Certainty = Literal["certain", "possible"]
Kind = Literal["op", "kernel", "communication", "parallel", "data", "setting"]
Fixer = Literal["deterministic", "kernels", "code"]

CERTAINTIES: Final[tuple[Certainty, ...]] = ("certain", "possible")
KINDS: Final[tuple[Kind, ...]] = ("op", "kernel", "communication", "parallel", "data", "setting")
FIXERS: Final[dict[Fixer, str]] = {
    "deterministic": "detrace.deterministic()",
    "kernels": 'detrace.deterministic(kernels="detrace")',
    "code": "a code change",
}
"""What removes a hazard, as the report names it."""


@dataclass(frozen=True, kw_only=True)
class Hazard:
    """One determinism hazard the run showed."""

    kind: Kind
    """op (an eager ATen op), kernel (an Inductor kernel), communication, parallel, data or setting."""
    certainty: Certainty
    """certain: it struck or strikes in this run as configured; possible: it strikes under another thread count,
    device, restart or setting, or the program may be exposed to it."""
    subject: str
    """The op ("aten.index_put_.default"), kernel, setting or object ("DataLoader #0") concerned."""
    what: str
    """Why it is a hazard here, with the numbers that show it (e.g. how many indices repeat)."""
    fix: str
    """What to do."""
    fixed_by: Fixer
    """What removes it: the recipe (`deterministic`), its kernel routes (`kernels`), or only a code change."""
    ranks: tuple[int, ...] = ()
    """The ranks where it showed (empty: outside any rank, e.g. the launcher's environment)."""
    step: int | None = None
    """The first global step where it showed."""
    phase: str | None = None
    """forward, backward, optimizer or recompute."""
    module: str | None = None
    """The innermost module in scope ("" for the top level)."""
    aten: tuple[str, ...] = ()
    """For a kernel: the ATen ops it was lowered from."""
    count: int = 1
    """How many times it showed (op calls, kernel loads)."""
    source: str = ""
    """Where the catalog entry or check comes from (torch's alerts, detrace's replay, detrace.ops, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown hazard kind {self.kind!r}")
        if self.certainty not in CERTAINTIES:
            raise ValueError(f"unknown certainty {self.certainty!r}")
        if self.fixed_by not in FIXERS:
            raise ValueError(f"unknown fixer {self.fixed_by!r}")
        if self.count < 1:
            raise ValueError(f"a hazard shows at least once, not {self.count}")

    @property
    def place(self) -> str:
        """Where it showed, for the terminal: rank, step, phase, module."""
        parts = []
        if self.ranks:
            parts.append(f"rank{'s' * (len(self.ranks) > 1)} {','.join(map(str, self.ranks))}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.phase:
            parts.append(self.phase)
        if self.module is not None:
            parts.append(f"module {self.module}" if self.module else "the root module")
        return ", ".join(parts)

    def key(self) -> tuple[Any, ...]:
        """What makes two hazards the same one (merged across ranks and calls)."""
        return (self.kind, self.certainty, self.subject, self.phase, self.module, self.fixed_by)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranks"] = list(self.ranks)
        data["aten"] = list(self.aten)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Hazard:
        try:
            return cls(**{**data, "ranks": tuple(data.get("ranks", ())), "aten": tuple(data.get("aten", ()))})
        except (TypeError, ValueError) as err:
            raise TraceError(f"malformed audit hazard {dict(data)!r}: {err}") from None


def merge(hazards: Iterable[Hazard]) -> list[Hazard]:
    """One hazard per `key()`: ranks united, counts added, the first step kept; certain ones first."""
    merged: dict[tuple[Any, ...], Hazard] = {}
    for hazard in hazards:
        seen = merged.get(hazard.key())
        if seen is None:
            merged[hazard.key()] = hazard
            continue
        steps = [s for s in (seen.step, hazard.step) if s is not None]
        merged[hazard.key()] = replace(seen, ranks=tuple(sorted({*seen.ranks, *hazard.ranks})),
                                       count=seen.count + hazard.count, step=min(steps) if steps else None,
                                       what=seen.what if seen.count >= hazard.count else hazard.what)
    return sorted(merged.values(), key=lambda h: (CERTAINTIES.index(h.certainty), KINDS.index(h.kind)))


@dataclass(frozen=True, kw_only=True)
class AuditReport:
    """Everything one `detrace audit` found."""

    hazards: tuple[Hazard, ...]
    """Merged across ranks, certain ones first."""
    command: tuple[str, ...] = ()
    """CMD (empty for the no-CMD form, which audits this process's settings)."""
    returncode: int | None = None
    """CMD's exit status."""
    ranks: tuple[int, ...] = ()
    """The ranks whose probe reported."""
    steps: int = 0
    """How many steps were audited: the most any rank ran in the window (fewer than asked when CMD ended
    early)."""
    out: str | None = None
    """The run directory."""
    notes: tuple[str, ...] = field(default=())
    """What the audit could not see (a rank that wrote nothing, CMD that failed)."""

    @property
    def certain(self) -> list[Hazard]:
        return [h for h in self.hazards if h.certainty == "certain"]

    @property
    def possible(self) -> list[Hazard]:
        return [h for h in self.hazards if h.certainty == "possible"]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "command": list(self.command), "returncode": self.returncode,
                "ranks": list(self.ranks), "steps": self.steps, "out": self.out,
                "verdict": "hazards" if self.certain else "clean",
                "certain": [h.to_json() for h in self.certain], "possible": [h.to_json() for h in self.possible],
                "notes": list(self.notes)}
