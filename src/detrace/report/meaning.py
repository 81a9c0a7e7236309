"""What a verdict means, in the user's words: the sentences that `check`, `check-resume` and `locate` share, kept in
one place so that every command says the same thing the same way."""

from __future__ import annotations

import shlex

from detrace.analyze.diff_result import DiffResult


def locate_command(cmd: list[str]) -> str:
    """The command that finds the culprit when runs of CMD differ."""
    return f"detrace locate -- {shlex.join(cmd)}"


def locate_next(cmd: list[str]) -> str:
    """What to run next when runs of CMD differ, as a sentence."""
    return f"find the culprit with: {locate_command(cmd)}"


def apart_notes(result: DiffResult | None) -> list[str]:
    """The result's notes about what was compared apart from the training (evaluations, checkpoint I/O, a
    framework's bookkeeping)."""
    if result is None:
        return []
    return [note for note in result.notes if "compared apart from the training" in note]


def short_run(steps: int, every: int) -> str:
    """locate's note for a run too short to reach its first periodic checkpoint."""
    return (f"the run has {steps} step{'s' * (steps != 1)}, no more than --checkpoint-every {every}, so it took no "
            "checkpoint and every narrow run re-ran it from step 0; on a longer run, or with a smaller "
            "--checkpoint-every, locate resumes them from a checkpoint next to the divergence")
