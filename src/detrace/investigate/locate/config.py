"""What one `detrace locate` is asked to do: its configuration, the embedded default command, the run budget."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from detrace.analyze.replay_result import ReplayConfig
from detrace.errors import UsageError
from detrace.workload import RACING_THREADS

BASE_RUNS = 7
"""Runs of a ladder whose every narrower pair reproduces the divergence: 2 + 2 + 2 + 1."""
MAX_RUNS = 14
"""Runs at most: a third broad run when the first pair is identical, the resume proof of a checkpointed ladder
(twice when the first resumed run differs), and each narrow pair once more."""

DEFAULT_STEPS = 8
"""Steps of the embedded default workload. Its race strikes in nearly every backward (the first pair parts at step
0), so fewer would do; eight show a divergence that spreads, and a step costs a fraction of a second."""

DEFAULT_CHECKPOINT_EVERY = 8
"""K when locate chooses: a narrow run resumed from a checkpoint executes at most K + 1 steps (six of them in a
ladder whose pairs reproduce the divergence), and the broad runs each write one checkpoint per K steps (run A's
are all kept, in OUT/checkpoints: a long run of a large model wants a larger `--checkpoint-every`)."""


def default_command(steps: int = DEFAULT_STEPS) -> list[str]:
    """The embedded default: the reference workload with its nondeterministic `index` MoE dispatch on
    `RACING_THREADS` (8) threads, so that its race strikes on a busy machine too."""
    return [sys.executable, "-m", "detrace.workload.train", "--preset", "tiny", "--steps", str(steps),
            "--threads", str(RACING_THREADS), "--dispatch", "index"]


@dataclass(frozen=True, kw_only=True)
class LocateConfig:
    """One `detrace locate` invocation."""

    command: tuple[str, ...]
    """CMD, exactly as `detrace run` would start it (a script, `python -m ...`, `torchrun ...`)."""
    out: Path
    """Directory that receives every run directory, locate.json, ladder.json and report.html."""
    timeout: float | None = 900.0
    """Seconds one run of CMD may take before it counts as hung; None waits forever."""
    retries: int = 1
    """Extra attempts of a narrow pair whose runs happen not to differ (nondeterminism is random)."""
    max_numel: int | None = None
    """Skip fingerprinting tensors above this many elements at the module and op rungs (shape still recorded)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """How the kernel rung replays the culprit."""
    env: dict[str, str] | None = None
    """Extra environment for CMD (the same for every run, so every arm starts from the same state)."""
    checkpoint_every: int | None = None
    """K: the broad runs of a CMD that follows the resume contract save a checkpoint every K steps, and the
    narrow runs resume from the last one before the divergence. None: `DEFAULT_CHECKPOINT_EVERY`."""
    checkpoints: bool = True
    """False: ask CMD for no checkpoint, so every run is a full run (the ladder before checkpoints)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("locate needs a command to run")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be a positive number of steps, not {self.checkpoint_every}")
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, not {self.timeout}")
        if not 0 <= self.retries <= 1:
            raise UsageError("locate retries a narrow pair at most once (retries must be 0 or 1)")
