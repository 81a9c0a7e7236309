"""`detrace spikes RUN`: the steps where a metric recorded at the metrics rung jumps above a robust threshold.

For each step t, the threshold is computed over the `window` steps before it that the run recorded:

    threshold(t) = median(x[t-W..t-1]) + k * MAD(x[t-W..t-1]),   MAD = median(|x - median|)

and t is a spike when x(t) > threshold(t). Median and MAD ignore the outliers they look for (a mean and a standard
deviation would be pulled up by the spike itself, and by an earlier one in the window), and a steady trend such
as a falling loss moves the median with it. A step needs `MIN_HISTORY` earlier values before it can be judged.
The MAD is at least `MAD_FLOOR` of the median: a constant metric (MAD 0) would make a 1-ulp bump a spike. A NaN or
an infinity is always a spike, judged or not, and stays out of the windows; once a metric is not finite it usually
stays so, and only the first such step is listed (the others are counted). A step's value is the mean over its
micro-batches (detrace.analyze.metrics).
Each spike names the last checkpoint saved before it (the resume contract's `saved_versions`), from which
`detrace ablate` replays it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.analyze.metrics import metric_rank, metric_series
from detrace.errors import TraceError, UsageError
from detrace.tracefile.layout import run_header_path
from detrace.verdicts import SPIKES, SpikesVerdict

SCHEMA = "detrace.spikes/1"
DEFAULT_METRIC = "loss"
DEFAULT_K = 6.0
"""k of the threshold: the training noise of a loss is a few MADs; a spike worth chasing is far beyond it."""
DEFAULT_WINDOW = 10
"""W: the trailing steps the threshold is taken over."""
MIN_HISTORY = 4
"""Earlier values a step needs before it can be judged: a median of fewer says little."""
MAD_FLOOR = 1e-4
"""The least MAD, relative to the median: a rise of k x 0.01% over a metric that never moved is the least spike."""
CHECKPOINT_DIR_KEY = "checkpoint_dir"
"""run.json's key for the DETRACE_CKPT_DIR the traced command was given (written by the launcher)."""


@dataclass(frozen=True, kw_only=True)
class SpikeRule:
    """How a spike is told from the noise of a metric."""

    k: float = DEFAULT_K
    """Multiples of the trailing window's MAD above its median."""
    window: int = DEFAULT_WINDOW
    """Trailing steps the median and the MAD are taken over."""

    def __post_init__(self) -> None:
        if not self.k > 0:
            raise UsageError(f"--k must be a positive number, not {self.k}")
        if self.window < MIN_HISTORY:
            raise UsageError(f"--window must be at least {MIN_HISTORY} steps, not {self.window}")

    def threshold(self, history: list[float]) -> float | None:
        """The threshold over `history` (the values of the steps before, oldest first; NaN and infinities left out);
        None when too short."""
        recent = [value for value in history if math.isfinite(value)][-self.window:]
        if len(recent) < MIN_HISTORY:
            return None
        median = statistics.median(recent)
        mad = max(statistics.median(abs(v - median) for v in recent), MAD_FLOOR * abs(median))
        return median + self.k * mad


def spiked(value: float, threshold: float) -> bool:
    """Whether `value` is a spike over `threshold`: above it, or not finite (NaN compares false with everything,
    yet a NaN or an infinite loss is the worst spike there is)."""
    return not math.isfinite(value) or value > threshold


@dataclass(frozen=True, kw_only=True)
class Spike:
    """One step whose metric is above the threshold of the steps before it."""

    step: int
    """The global step (as the trace counts it: steps completed before it)."""
    value: float
    """The metric's exact value at that step."""
    threshold: float | None
    """median + k * MAD of the trailing window; None for a value that is not finite (always a spike) where the
    step had too little history to have one."""
    checkpoint: int | None = None
    """Completed steps of the last checkpoint saved before the step (a run resumed from it executes the step);
    None when the run saved none before it."""
    checkpoint_path: str | None = None
    """Where that checkpoint is (what DETRACE_RESUME_FROM takes)."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value)

    def to_json(self) -> dict[str, Any]:
        # JSON has no NaN or infinity: those values are written as the strings "nan", "inf", "-inf".
        return {"step": self.step, "value": self.value if self.finite else str(self.value),
                "threshold": self.threshold, "checkpoint": self.checkpoint, "checkpoint_path": self.checkpoint_path}


def find_spikes(series: Mapping[int, float], rule: SpikeRule) -> list[tuple[int, float, float | None]]:
    """(step, value, threshold) of every spike in `series` (step -> value), in step order: the steps above their
    threshold, and the first step whose value is not finite (see the module's docstring)."""
    found: list[tuple[int, float, float | None]] = []
    history: list[float] = []
    nonfinite = False
    for step in sorted(series):
        value = series[step]
        threshold = rule.threshold(history)
        if not math.isfinite(value):
            if not nonfinite:
                found.append((step, value, threshold))
            nonfinite = True
        elif threshold is not None and spiked(value, threshold):
            found.append((step, value, threshold))
        history.append(value)
    return found


def judged(series: Mapping[int, float]) -> int:
    """Steps with enough finite history before them to be judged against a threshold."""
    finite = sum(1 for value in series.values() if math.isfinite(value))
    return max(0, finite - MIN_HISTORY)


def checkpoint_before(versions: Mapping[int, Path], step: int) -> int | None:
    """The last checkpoint from which a resumed run executes `step` and at least the step before it
    (completed steps C < step), or None."""
    return max((c for c in versions if c < step), default=None)


def checkpoint_dir_of(run: Path) -> Path | None:
    """The DETRACE_CKPT_DIR that run.json says the traced command was given, or None."""
    try:
        header = json.loads(run_header_path(run).read_text())
    except (OSError, ValueError):
        return None
    named = header.get(CHECKPOINT_DIR_KEY) if isinstance(header, dict) else None
    return Path(named) if named else None


def checkpoints_of(run: Path, checkpoints: Path | None = None) -> dict[int, Path]:
    """The checkpoints of a traced run: in `checkpoints` when given, else in the directory its run.json names."""
    from detrace.state.contract import saved_versions  # imports torch: only when a run is looked at

    if checkpoints is not None and not checkpoints.is_dir():
        raise UsageError(f"--checkpoints {checkpoints} is not a directory")
    root = checkpoints or checkpoint_dir_of(run)
    return saved_versions(root) if root is not None else {}


def series_of(run: Path, metric: str, rank: int | None = None) -> tuple[int, dict[int, float]]:
    """(rank, step -> value) of `metric` in a traced run: the given rank, or the lowest that recorded metrics."""
    if rank is not None and rank < 0:
        raise UsageError(f"--rank must be a rank (0 or more), not {rank}")
    if rank is None:
        rank = metric_rank(run)
        if rank is None:
            raise TraceError(f"{run} recorded no metrics: trace the run with `detrace run` (any rung)")
    series = metric_series(run, rank)
    if metric not in series:
        known = ", ".join(sorted(series)) or "none"
        raise UsageError(f"{run} recorded no metric {metric!r} on rank {rank} (it has: {known})")
    return rank, series[metric]


@dataclass(frozen=True, kw_only=True)
class SpikesResult:
    """`detrace spikes` on one run."""

    run: Path
    metric: str
    rank: int
    rule: SpikeRule
    steps: int
    """Steps the metric was recorded at."""
    judged: int
    """Of those, the steps that had enough history to be judged against a threshold."""
    nonfinite: int
    """Steps whose value is NaN or infinite (the first is a spike)."""
    spikes: tuple[Spike, ...]
    checkpoint_dir: str | None
    """Where the checkpoints were looked for; None when run.json names no directory and none was given."""

    @property
    def verdict(self) -> SpikesVerdict:
        return "spikes" if self.spikes else "clean"

    @property
    def exit_code(self) -> int:
        return SPIKES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "verdict": self.verdict, "run": str(self.run), "metric": self.metric,
                "rank": self.rank, "k": self.rule.k, "window": self.rule.window, "steps": self.steps,
                "judged": self.judged, "nonfinite": self.nonfinite,
                "checkpoint_dir": self.checkpoint_dir, "spikes": [s.to_json() for s in self.spikes]}


def spikes(run: Path, *, metric: str = DEFAULT_METRIC, rule: SpikeRule | None = None, rank: int | None = None,
           checkpoints: Path | None = None) -> SpikesResult:
    """The spikes of `metric` in the traced run `run`, each with the checkpoint to replay it from."""
    rule = rule or SpikeRule()
    rank, series = series_of(run, metric, rank)
    root = checkpoints or checkpoint_dir_of(run)
    versions = checkpoints_of(run, checkpoints)
    nonfinite = sum(1 for value in series.values() if not math.isfinite(value))
    if not judged(series) and not nonfinite:
        raise TraceError(f"{run} recorded {metric!r} at {len(series)} step{'s' * (len(series) != 1)} on rank {rank}: "
                         f"a step needs {MIN_HISTORY} earlier ones to be judged, so nothing was judged")
    found = []
    for step, value, threshold in find_spikes(series, rule):
        before = checkpoint_before(versions, step)
        found.append(Spike(step=step, value=value, threshold=threshold, checkpoint=before,
                           checkpoint_path=None if before is None else str(versions[before])))
    return SpikesResult(run=run, metric=metric, rank=rank, rule=rule, steps=len(series), judged=judged(series),
                        nonfinite=nonfinite, spikes=tuple(found),
                        checkpoint_dir=None if root is None else str(root))
