"""What to record: the tracer's configuration, its capture selector, and how both travel through the environment.

The launcher (`detrace run`) and the library form (`detrace.trace(...)`) build the same `TraceConfig`; the
launcher hands it to every Python process CMD starts as one JSON environment variable, `DETRACE_TRACE`, which the
injected `sitecustomize` reads. A process without that variable is never touched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detrace._numbers import parse_count
from detrace.errors import UsageError
from detrace.tracefile.schema import RUNGS
from detrace.tracefile.selection import Window, parse_window

ENV_VAR = "DETRACE_TRACE"
"""The environment variable that carries a `TraceConfig` (as JSON) into the processes CMD starts."""
RECORDING_VAR = "DETRACE_RECORDING_PID"
"""Set by a traced process when it records its first record, to its pid (and removed when it closes its trace):
a child it starts meanwhile inherits it and knows that its parent's rank file is taken. The torchrun agent
removes it for its workers, and `detrace run` for CMD: each is the root of a job of its own."""

_SELECTOR_KEYS = ("step", "rank", "phase", "name", "occurrence", "module")


@dataclass(frozen=True, kw_only=True)
class CaptureSelector:
    """Which op call the kernel rung saves: `step=3,rank=1,phase=backward,name=aten.index_put_.default,occurrence=0`.

    Every key is optional except `name`; a missing key matches anything, so the first matching call is saved
    for each combination of the missing keys (e.g. every rank when `rank` is absent).
    """

    name: str
    """The op overload, e.g. "aten.index_put_.default"."""
    step: int | None = None
    """The step the call happens in."""
    rank: int | None = None
    """The rank the call happens on."""
    phase: str | None = None
    """forward, backward, optimizer or recompute."""
    occurrence: int | None = None
    """How many calls with the same (phase, module, name) came before it in the step."""
    module: str | None = None
    """The innermost module in scope ("" for none)."""
    spec: str = ""
    """The selector text it was parsed from, kept for headers and messages."""

    def __post_init__(self) -> None:
        if not self.name:
            raise UsageError(f"capture selector {self.spec!r} has no name=OP (e.g. name=aten.index_put_.default)")

    @classmethod
    def parse(cls, spec: str) -> CaptureSelector:
        """Parse `key=value,key=value,...`; unknown keys and non-integer step/rank/occurrence are usage errors."""
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in _SELECTOR_KEYS:
                raise UsageError(f"malformed capture selector {spec!r}: {item!r} is not one of "
                                 f"{', '.join(k + '=...' for k in _SELECTOR_KEYS)}")
            if key in ("step", "rank", "occurrence"):
                number = parse_count(value)
                if number is None:
                    raise UsageError(f"malformed capture selector {spec!r}: {key} must be a non-negative integer")
                values[key] = number
            else:
                values[key] = value.strip()
        return cls(spec=spec, name=values.pop("name", ""), **values)

    def matches(self, *, step: int, rank: int | None, phase: str, module: str | None, name: str,
                occurrence: int) -> bool:
        """Whether one op call is the one to capture."""
        return (name == self.name
                and (self.step is None or step == self.step)
                and (self.rank is None or rank == self.rank)
                and (self.phase is None or phase == self.phase)
                and (self.occurrence is None or occurrence == self.occurrence)
                and (self.module is None or (module or "") == self.module))


def _steps_windows(steps: str | Mapping[str, str]) -> dict[str, Window]:
    if isinstance(steps, str):
        window = parse_window(steps)
        return dict.fromkeys(RUNGS, window)
    unknown = sorted(set(steps) - set(RUNGS))
    if unknown:
        raise UsageError(f"unknown rung {unknown[0]!r} in the step windows; choose from {', '.join(RUNGS)}")
    return {rung: parse_window(steps.get(rung, "all")) for rung in RUNGS}


def parse_steps_option(values: list[str]) -> str | dict[str, str]:
    """The CLI form of per-rung step windows: `--steps SPEC` for every rung, `--steps RUNG=SPEC` for one.

    A plain SPEC sets the default of every rung; `RUNG=SPEC` items (later ones win) override one rung.
    """
    default = "all"
    per_rung: dict[str, str] = {}
    for value in values:
        rung, sep, spec = value.partition("=")
        if sep:
            if rung not in RUNGS:
                raise UsageError(f"unknown rung {rung!r} in --steps {value!r}; choose from {', '.join(RUNGS)}")
            per_rung[rung] = spec
        else:
            default = value
    if not per_rung:
        return default
    return {rung: per_rung.get(rung, default) for rung in RUNGS}


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """Everything a process needs to record its trace."""

    out: Path
    """The run directory; each rank writes `rank-RRRRR.arrow` there."""
    rung: str = "metrics"
    """The highest rung recorded: metrics, semantic, module or op (each includes the ones before it)."""
    steps: str | Mapping[str, str] = "all"
    """Step window: one SPEC for every rung, or {rung: SPEC} (rungs not named record every step)."""
    ranks: str = "all"
    """Rank window (SPEC): ranks outside it record nothing and write no file."""
    max_numel: int | None = None
    """Tensors with more elements are recorded with shape, dtype and numel but no digest (null)."""
    force: bool = False
    """Replace a trace already in `out` instead of refusing."""
    capture: str | None = None
    """Kernel-rung capture selector (see `CaptureSelector`), or None."""
    command: tuple[str, ...] | None = None
    """The command being traced, for headers (the launcher sets it; the library form uses sys.argv)."""
    launched: bool = False
    """True inside processes started by `detrace run` (the launcher owns run.json and the --force cleanup)."""
    step_windows: dict[str, Window] = field(init=False, repr=False, compare=False)
    """Parsed `steps`, one window per rung."""
    rank_window: Window = field(init=False, repr=False, compare=False)
    """Parsed `ranks`."""
    selector: CaptureSelector | None = field(init=False, repr=False, compare=False)
    """Parsed `capture`."""

    def __post_init__(self) -> None:
        if self.rung not in RUNGS:
            raise UsageError(f"unknown rung {self.rung!r}; choose from {', '.join(RUNGS)}")
        if self.max_numel is not None and (isinstance(self.max_numel, bool) or not isinstance(self.max_numel, int)
                                           or self.max_numel < 0):
            raise UsageError(f"--max-numel must be a non-negative integer, not {self.max_numel!r}")
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "step_windows", _steps_windows(self.steps))
        object.__setattr__(self, "rank_window", parse_window(self.ranks))
        object.__setattr__(self, "selector", CaptureSelector.parse(self.capture) if self.capture else None)
        if self.selector is not None and self.rung != "op":
            raise UsageError("--capture needs --rung op (captures are taken from the op rung's calls)")

    def windows(self) -> dict[str, Any]:
        """The windows in force, as written to headers."""
        return {"steps": {rung: self.step_windows[rung].spec for rung in RUNGS},
                "ranks": self.rank_window.spec, "max_numel": self.max_numel, "capture": self.capture}

    def to_env(self) -> str:
        """The JSON value of `DETRACE_TRACE`."""
        return json.dumps({"out": str(self.out), "rung": self.rung,
                           "steps": self.steps if isinstance(self.steps, str) else dict(self.steps),
                           "ranks": self.ranks, "max_numel": self.max_numel, "force": self.force,
                           "capture": self.capture, "command": list(self.command or ()), "launched": self.launched})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TraceConfig | None:
        """The configuration the launcher put in the environment, or None when this process is not traced."""
        text = environ.get(ENV_VAR)
        if not text:
            return None
        try:
            data = json.loads(text)
            data["command"] = tuple(data.get("command") or ()) or None
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise UsageError(f"{ENV_VAR} holds no valid tracer configuration: {err}") from None
