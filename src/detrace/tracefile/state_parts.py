"""The training state, part by part, as the optimizer step after K completed steps begins (K a stop point of
`detrace check-resume`): what a resumed run restored, compared bit for bit with the continuous run's state at the
same point. The tracer (detrace.record.rungs.state_parts) appends one JSON line per optimizer and stop point."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from detrace.tracefile.layout import STATE_PARTS_GLOB, read_json_lines

ENV_STATE_AT = "DETRACE_STATE_AT"
"""K[,K2...]: the traced process digests its state as the optimizer step after K completed steps begins."""
RNG_PARTS = ("torch RNG state", "CUDA RNG states", "Python RNG state", "NumPy RNG state")
"""The RNG states, each a part of its own: a script that never seeds Python's or NumPy's generator has another
state of it in every process, which matters only if the training draws from it."""
RECORDED = ("parameters", "optimizer state", "param groups", "scheduler", *RNG_PARTS)
"""The parts the tracer digests, in the order they are shown; the data position is the trace's own input batch."""
PARTS = (*RECORDED, "data position")
"""Every part compared, in the order they are shown."""


@dataclass(frozen=True, kw_only=True)
class StateParts:
    """One optimizer's state, part by part, in one process at one stop point."""

    step: int
    """Optimizer steps completed (a global step: a resumed run counts on from its checkpoint)."""
    rank: int
    optimizer: int
    """Which optimizer of the process: 0 for the first whose step began at `step`, 1 for the next..."""
    parts: dict[str, str | None]
    """A digest of each part's exact bits, by name (`RECORDED`); None when the run has no such part (no scheduler)."""
    shown: dict[str, str] = field(default_factory=dict)
    """Values shown next to a difference: the param groups' learning rate and weight decay, the schedulers' step."""

    def __post_init__(self) -> None:
        if set(self.parts) != set(RECORDED):
            raise ValueError(f"parts must be {', '.join(RECORDED)}, not {', '.join(self.parts)}")
        if self.step < 0 or self.rank < 0 or self.optimizer < 0:
            raise ValueError("step, rank and optimizer must be >= 0")


def read_state_parts(run: Path) -> list[StateParts]:
    """Every state record of the run's processes."""
    return read_json_lines(run, STATE_PARTS_GLOB, lambda item: StateParts(
        step=int(item["step"]), rank=int(item["rank"]), optimizer=int(item["optimizer"]), parts=dict(item["parts"]),
        shown=dict(item.get("shown", {}))), "a state record")
