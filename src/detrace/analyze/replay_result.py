"""The kernel rung's records: what a replay is asked (`ReplayConfig`) and what it found (`ArmResult`,
`ReplayResult`, the `detrace.replay/1` object), and the switches it names as fixes. Kept apart from
`detrace.investigate.replay`, which executes ops and needs torch, so that the ladder's and the report's readers do
not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from detrace.errors import UsageError
from detrace.tracefile.metadata import Fields

FIX_DETERMINISTIC = "torch.use_deterministic_algorithms(True)"
FIX_ONE_THREAD = "torch.set_num_threads(1)"
ADVICE_COMPILED = ("torch.use_deterministic_algorithms(True) before torch.compile (Inductor then falls back to "
                   "ATen's deterministic kernels for {ops})")
ADVICE_EAGER = ("torch.compiler.disable on {module} (its ops then run eagerly, where "
                "torch.use_deterministic_algorithms(True) applies at run time)")

REPLAY_SCHEMA = "detrace.replay/1"


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """How hard the kernel rung tries. The defaults find the CPU accumulate kernels' nondeterminism reliably."""

    repeats: int = 20
    """Least number of executions of the op per arm; each compares its outputs with the arm's first one."""
    min_seconds: float = 2.0
    """Keep repeating an arm that has shown no difference yet until it has run this long: a race between
    threads only shows when the OS runs them at the same moment."""
    max_repeats: int = 1000
    """Most executions per arm while `min_seconds` has not passed."""
    threads: tuple[int, ...] | None = None
    """Intra-op thread counts to try; None means 1 and the traced run's count (at least 2, so a capture taken
    on one thread is still tried with a parallel kernel)."""

    def __post_init__(self) -> None:
        if self.repeats < 2:
            raise UsageError(f"replay needs at least 2 repeats to compare, not {self.repeats}")
        if self.max_repeats < self.repeats or self.min_seconds < 0:
            raise UsageError("replay needs max_repeats >= repeats and a non-negative min_seconds")
        if self.threads is not None and (not self.threads or min(self.threads) < 1):
            raise UsageError(f"replay thread counts must be positive integers, not {self.threads}")


@dataclass(frozen=True, kw_only=True)
class ArmResult:
    """The op under one (threads, deterministic) setting."""

    threads: int
    deterministic: bool
    """torch.use_deterministic_algorithms was on."""
    repeats: int
    """Executions that completed."""
    distinct: int
    """Distinct output bit patterns among the repeats (1 = deterministic)."""
    differing_elements: int
    """Largest number of output elements that differed from the first repeat, over all repeats."""
    max_ulp: int
    """Largest difference from the first repeat in units in the last place (integers: in units)."""
    matches_capture: bool
    """The first repeat reproduced the traced run's own output bits."""
    error: str | None = None
    """Why the arm could not run, e.g. the op has no deterministic implementation."""

    @property
    def nondeterministic(self) -> bool:
        return self.error is None and self.distinct > 1

    def note(self, base: ArmResult) -> str:
        """The arm in words beside its figures (the terminal's and the report's table): why it could not run, or
        whether it gave the traced run's own output bits, and why not (`base`: the arm with the run's setting)."""
        if self.error is not None:
            return self.error
        if self.matches_capture:
            return "reproduces the traced run's output bits"
        if self.nondeterministic:
            return "its outputs vary from repeat to repeat; the traced run's bits were another outcome of the race"
        if (self.threads, self.deterministic) != (base.threads, base.deterministic):
            return "one output every repeat; not the traced run's bits, which another setting gave"
        return "one output every repeat, but not the traced run's bits"

    def to_json(self) -> dict[str, Any]:
        return {"threads": self.threads, "deterministic": self.deterministic, "repeats": self.repeats,
                "distinct": self.distinct, "differing_elements": self.differing_elements,
                "max_ulp": self.max_ulp, "matches_capture": self.matches_capture, "error": self.error}

    @classmethod
    def from_json(cls, raw: object, source: str) -> ArmResult:
        f = Fields(raw, source)
        return cls(threads=f.count("threads", least=1), deterministic=f.get("deterministic", bool, "true or false"),
                   repeats=f.count("repeats"), distinct=f.count("distinct"),
                   differing_elements=f.count("differing_elements"), max_ulp=f.count("max_ulp"),
                   matches_capture=f.get("matches_capture", bool, "true or false"),
                   error=f.get("error", str, "a string", default=None))


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """The kernel rung's verdict on one captured op call."""

    op: str
    meta: dict[str, Any]
    """Where the call came from (rank, step, phase, module, occurrence, seq, threads, deterministic)."""
    shapes: list[dict[str, Any]]
    """dtype and shape of each tensor input ("in") and traced output ("out"), in call order."""
    base: ArmResult
    """The arm with the traced run's thread count and deterministic setting."""
    arms: list[ArmResult] = field(default_factory=list)
    fixed_by: list[str] = field(default_factory=list)
    """Switches that, applied alone to the base setting, make the op deterministic."""
    advice: list[str] = field(default_factory=list)
    """For a racing compiled kernel: compile-time switches that remove the race (not tried by the replay)."""

    @property
    def nondeterministic(self) -> bool:
        return self.base.nondeterministic

    def summary(self) -> dict[str, Any]:
        """The `replay` object of the `detrace.locate/1` JSON (docs/locate.md)."""
        return {"nondeterministic": self.nondeterministic, "repeats": self.base.repeats,
                "differing_elements": self.base.differing_elements, "max_ulp": self.base.max_ulp,
                "fixed_by": list(self.fixed_by)}

    def to_json(self) -> dict[str, Any]:
        """`detrace.replay/1`: the summary plus the op, its origin, shapes and every arm."""
        return {"schema": REPLAY_SCHEMA, "op": self.op, **self.summary(), "meta": self.meta,
                "shapes": self.shapes, "base": self.base.to_json(), "arms": [a.to_json() for a in self.arms],
                "advice": list(self.advice)}

    @classmethod
    def from_json(cls, raw: object, source: str) -> ReplayResult:
        """A `detrace.replay/1` object read back (the summary's keys are derived, so they are not read)."""
        f = Fields(raw, source)
        if f.get("schema", str, "a string") != REPLAY_SCHEMA:
            raise f.fail("schema", repr(REPLAY_SCHEMA))
        shapes = f.get("shapes", list, "a list of objects")
        if not all(isinstance(s, dict) for s in shapes):
            raise f.fail("shapes", "a list of objects")
        return cls(op=f.get("op", str, "a string"), meta=f.get("meta", dict, "an object"), shapes=shapes,
                   base=ArmResult.from_json(f.get("base", dict, "an object"), f"{source} (field 'base')"),
                   arms=[ArmResult.from_json(a, f"{source} (arms[{i}])")
                         for i, a in enumerate(f.get("arms", list, "a list of arms"))],
                   fixed_by=f.strings("fixed_by"), advice=f.strings("advice", default=[]))
