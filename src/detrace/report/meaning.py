"""What a verdict means, in the user's words: the sentences that `check`, `check-resume` and `locate` share, kept in
one place so that every command says the same thing the same way."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from detrace.analyze.diff_result import DiffResult, Divergence
from detrace.tracefile.layout import run_header_path
from detrace.tracefile.state_parts import RNG_PARTS


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


FORGOT_PART = {
    "parameters": "the model's parameters are not the continuous run's: does your checkpoint save and load every "
                  "part of the model?",
    "optimizer state": "the optimizer's state (its moments, its step counts) is not the continuous run's: does your "
                       "checkpoint save the optimizer's state_dict, and load it into the optimizer the run steps?",
    "param groups": "the learning rate or weight decay is not the one the continuous run had: does your checkpoint "
                    "save the optimizer (its param groups) and the scheduler?",
    "scheduler": "the learning-rate scheduler is not where the continuous run's was: does your checkpoint save the "
                 "scheduler?",
    **dict.fromkeys(RNG_PARTS, "the RNG state is not the continuous run's (a dropout mask, an augmentation will "
                               "differ): does your checkpoint save and restore the RNG states (torch's, NumPy's, "
                               "Python's)?"),
    "data position": "the data order or position is not the continuous run's: the resumed run trained on another "
                     "batch; does your checkpoint save where the data loader was (its sampler's epoch and position)?",
}
"""What a checkpoint forgot, in a user's words, for each part of the restored state (detrace.tracefile.state_parts'
PARTS) that differs from the continuous run's."""


OUTSIDE = ("the parts detrace compares (the model's parameters, the optimizer, the RNG states, the data position) "
           "do not explain it: the script keeps state outside the model and the optimizer that its checkpoint does "
           "not restore (an EMA copy of the weights, a buffer held in a Python object, a step counter); does your "
           "checkpoint save it?")
"""What a resume forgot when every part compared was restored exactly and the run still changed."""
AUGMENTED = ("the same samples arrived, but their random augmentation is not the continuous run's: it draws from "
             "an RNG the resume does not restore (the data loader workers' seeds, or the RNG it shares with the "
             "training loop); does your checkpoint save the RNG states, or does your data loader seed each sample?")
"""What a resume forgot when step K's batch holds the continuous run's samples, augmented otherwise."""


def forgotten(first: Divergence | None, differing: Sequence[str] = (), equal: Sequence[str] = ()) -> str | None:
    """What a resume that changed the run did not restore, in the words of a user's checkpoint: from the parts of
    the restored state that differ from the continuous run's (`differing`, the surest), else from the first
    divergence between the continuous and the resumed run; None when neither says anything about it. `equal`: the
    parts compared equal (or whose difference is known to be harmless): a part in it is never named, and when no
    part differs, what is left is named (state kept outside the model and the optimizer, an augmentation)."""
    if differing:
        return " ".join(dict.fromkeys(FORGOT_PART[part] for part in differing))  # each sentence once
    if first is None or first.kind != "numeric":
        return None
    if first.phase == "data":
        return AUGMENTED if "data position" in equal else FORGOT_PART["data position"]
    if equal and (first.phase in ("forward", "backward", "final", "evaluation")
                  or (first.phase == "optimizer" and first.origin)):
        # No part differs: nothing the comparison covers explains it ("final": an EMA saved at the end;
        # "evaluation": an EMA evaluated at the checkpoints, the training steps all equal).
        return OUTSIDE
    if first.phase == "optimizer" and first.origin:
        return ("the learning rate or optimizer state is not the one the continuous run had: an optimizer step "
                "made other parameters from the same gradients; does your checkpoint save the scheduler (and the "
                "optimizer's state)?")
    if first.phase in ("forward", "backward"):
        return ("the RNG state (a dropout mask, an augmentation), or the model, is not the continuous run's: the "
                "same batch gave another result; does your checkpoint save and restore the RNG states (torch's, "
                "NumPy's, Python's) and every part of the model?")
    return None
