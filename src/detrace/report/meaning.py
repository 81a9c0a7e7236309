"""What a verdict means, in the user's words: the sentences that `check`, `check-resume` and `locate` share, kept in
one place so that every command says the same thing the same way."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from detrace.analyze.diff_result import DiffResult
from detrace.tracefile.layout import run_header_path


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


def warned(*runs: Path | str | None) -> list[str]:
    """"the run warned: ..." for each warning an integration gave in `runs` (their run.json), each once: repeated
    next to a divergence, which it may explain."""
    found: list[str] = []
    for run in runs:
        if run is None:
            continue
        try:
            header = json.loads(run_header_path(Path(run)).read_text())
        except (OSError, ValueError):
            continue
        said = header.get("warnings") if isinstance(header, dict) else None
        if isinstance(said, list):
            found += [text for text in said if isinstance(text, str) and text not in found]
    return [f"the run warned: {text}" for text in found]
