"""The environment contract by which `detrace check-resume`, `detrace locate` (or a job scheduler) make an
unmodified training script stop, save and resume, and the checkpoint layouts a script following it leaves:

    DETRACE_CKPT_DIR=path       where checkpoints go
    DETRACE_STOP_AT=K           after step K completes, save and stop the training loop
    DETRACE_CKPT_EVERY=K        also save after every K-th step, keeping every version
    DETRACE_RESUME=1            load the last checkpoint in DETRACE_CKPT_DIR at start
    DETRACE_RESUME_FROM=path    load this checkpoint at start (one of the versions listed by `saved_versions`)
    DETRACE_RESUME_CONTROL=...  negative control, a deliberately wrong restore that leaves one part of the state
                                out: skip-rng, skip-data, skip-optimizer or skip-model (`CONTROLS`)
    DETRACE_SKIP_STEPS=a-b      data control: the batches of global steps a..b are never trained on; at step a
                                the loader advances past them, so steps a, a+1, ... get the batches of b+1, ...
    DETRACE_DATA_SHIFT=k        data control: from the first step this process runs (the resumed step), every
                                step gets the batch of the step k later (the loader advances k batches first)
    DETRACE_DROP_SAMPLES=i,j    data control: the samples of dataset indices i, j, ... are never trained on; the
                                sampler hands out the next ones in their place (detrace's framework integrations)
    DETRACE_RESTORE_PART=part:path  state control: after the resume's load, one part of the state comes from the
                                checkpoint at path instead: lr, moments or weights (`RESTORE_PARTS`)

Global steps count as traces count them: global step g runs after g completed steps (a run resumed from the
checkpoint after K steps runs global step K first). `detrace ablate` uses the data controls to change the data
of a replay and nothing else, and the state control to tell which part of the state carries a spike.

`TrainState` implements it for a hand-written loop; the framework integrations implement it for transformers'
and Lightning's trainers, each in its framework's own checkpoint layout (`LAYOUTS`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from detrace._numbers import parse_count
from detrace.errors import CheckpointCorrupted, CheckpointError, UsageError

ENV_CKPT_DIR = "DETRACE_CKPT_DIR"
ENV_STOP_AT = "DETRACE_STOP_AT"
ENV_CKPT_EVERY = "DETRACE_CKPT_EVERY"
ENV_RESUME = "DETRACE_RESUME"
ENV_RESUME_FROM = "DETRACE_RESUME_FROM"
ENV_RESUME_CONTROL = "DETRACE_RESUME_CONTROL"
ENV_SKIP_STEPS = "DETRACE_SKIP_STEPS"
ENV_DATA_SHIFT = "DETRACE_DATA_SHIFT"
ENV_DROP_SAMPLES = "DETRACE_DROP_SAMPLES"
ENV_RESTORE_PART = "DETRACE_RESTORE_PART"
CHECKPOINT_VARIABLES = (ENV_CKPT_DIR, ENV_STOP_AT, ENV_CKPT_EVERY, ENV_RESUME, ENV_RESUME_FROM, ENV_RESUME_CONTROL)
"""The variables that tell a run where to save and what to resume: the commands that run CMD (ablate, check-resume,
locate) set them for each run, on checkpoints of that run's own."""

# Negative controls: each leaves out one part of the restore, so a resume check can prove it would notice, and
# say which parts of the state the rest of the run depends on. In the order `detrace check-resume` tries them: the
# cheapest to get wrong unnoticed first, the model (which nearly every run depends on) last.
CONTROLS = {
    "skip-rng": "do not restore the RNG states",
    "skip-data": "do not restore the data position",
    "skip-optimizer": "do not restore the optimizer's per-parameter state (moments, step counts): start it empty",
    "skip-model": "do not restore the model's parameters and buffers",
}
RESTORE_PARTS = {
    "lr": "the learning rate: the LR scheduler's state and the optimizer's param groups",
    "moments": "the optimizer's per-parameter state (moments, step counts)",
    "weights": "the model's parameters and buffers",
}
"""The parts DETRACE_RESTORE_PART takes from another checkpoint, each what it replaces."""
MODEL_CONTROL = "skip-model"
"""The control that a framework which restores the model itself (transformers, accelerate, Lightning) cannot apply:
detrace's state is restored over the framework's, so leaving it out would leave the framework's restored model."""

# check-resume --native speaks to the tracer, not to the script (detrace.record.rungs.checkpoints acts on them).
ENV_NATIVE_STOP_AT = "DETRACE_NATIVE_STOP_AT"
"""The traced process ends as the optimizer step after K completed steps begins (after the script's save at K)."""
ENV_NATIVE_CONTROL = "DETRACE_NATIVE_CONTROL"
"""A negative control applied to what the script's `torch.load` returns: one of `NATIVE_CONTROLS`."""
ENV_NATIVE_RNG = "DETRACE_NATIVE_RNG"
"""For skip-rng: JSON {absolute file path: [[kind, key path], ...]}, where the save that wrote each file put RNG
states (from the stopped run's checkpoint log)."""
ENV_NATIVE_SAVED = "DETRACE_NATIVE_SAVED"
"""For a resumed arm: JSON {absolute path: completed steps}, the files and folders the stopped run saved and the
optimizer steps it had completed at each save (from its checkpoint log): a process that loads one of them counts
its steps on from there, whatever its optimizer keeps (SGD keeps no step count, a checkpoint may leave it out)."""
NATIVE_CONTROLS = ("skip-rng", "skip-optimizer")
"""The controls the tracer applies at a load, in the order check-resume --native tries them."""

HF_STATE_DIR = "detrace"
"""transformers and detrace.integrations.accelerate: detrace's verified state lives in `checkpoint-N/detrace/`, beside
the framework's files."""
LIGHTNING_STATE_SUFFIX = ".detrace"
"""Lightning: beside `<name>.ckpt`, detrace's verified state lives in `<name>.ckpt.detrace/`."""


def lightning_checkpoint(root: Path, step: int) -> Path:
    """Where the Lightning integration saves the contract's checkpoint after global step `step`."""
    return root / f"step-{step:08d}.ckpt"


class Layout(NamedTuple):
    """How one kind of script names the checkpoint of completed step N, and where detrace's state is in it."""

    pattern: re.Pattern[str]
    """Matches the checkpoint's name in DETRACE_CKPT_DIR; group 1 is the number of completed steps."""
    state: Callable[[Path], Path]
    """From the checkpoint's path to the TrainState checkpoint (a root or a version) that verifies it."""


LAYOUTS = (
    Layout(re.compile(r"step-(\d{8,})(?:\.\d+)?"), lambda path: path),  # TrainState: a version directory
    Layout(re.compile(r"checkpoint-(\d+)"), lambda path: path / HF_STATE_DIR),  # transformers
    Layout(re.compile(r"step-(\d+)\.ckpt"), lambda path: Path(f"{path}{LIGHTNING_STATE_SUFFIX}")),  # Lightning
)


def saved_versions(root: Path) -> dict[int, Path]:
    """The complete checkpoints a run saved in `root`, in any of the `LAYOUTS`: completed steps -> the path that
    DETRACE_RESUME_FROM takes. Complete means detrace's manifest, written last, is there; none when the run
    ignored the contract."""
    found: dict[int, Path] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        for layout in LAYOUTS:
            match = layout.pattern.fullmatch(entry.name)
            if match and _complete(layout.state(entry)):
                found.setdefault(int(match.group(1)), entry)
    return found


def state_of(path: Path) -> Path:
    """The TrainState checkpoint that verifies the checkpoint at `path` (any of the `LAYOUTS`)."""
    return next((layout.state(path) for layout in LAYOUTS if layout.pattern.fullmatch(path.name)), path)


def resume_problem(path: Path) -> str | None:
    """Why a checkpoint the contract resumes from (DETRACE_RESUME_FROM, any of the `LAYOUTS`) cannot be resumed,
    as a clause naming the cause, or None when it is there and matches its manifest."""
    from detrace.state import verify_checkpoint  # the package's own __init__: imported when needed

    if not path.exists():
        return f"the checkpoint it resumes from, {path}, is gone (no checkpoint)"
    try:
        verify_checkpoint(state_of(path))
    except CheckpointCorrupted as err:
        return f"the checkpoint it resumes from is corrupted (CheckpointCorrupted: {err})"
    except CheckpointError as err:
        return f"the checkpoint it resumes from cannot be read (CheckpointError: {err})"
    return None


def _complete(state: Path) -> bool:
    # Imported here: the checkpoint modules import torch.distributed.checkpoint (see TrainState._shared), and every
    # training process that follows the contract imports this module, most of them without resuming.
    from detrace.state import versions
    from detrace.state.manifest import MANIFEST_FILE

    try:
        return (versions.resolve(state) / MANIFEST_FILE).is_file()
    except CheckpointError:
        return False


def _step_variable(name: str) -> int | None:
    """A step count of at least 1 from the environment variable `name`, or None when it is unset."""
    text = os.environ.get(name)
    if text is None:
        return None
    step = parse_count(text)
    if step is None or step < 1:
        # Set but empty (`DETRACE_CKPT_EVERY=` in a script) is refused too: taken as unset, the saves it asked for
        # were silently never made.
        empty = " (set but empty: give a step or unset it)" if not text.strip() else ""
        raise UsageError(f"{name} must be a step number of at least 1, not {text!r}{empty}")
    return step


def resume_requested(*, framework: str | None = None) -> tuple[bool, str | None]:
    """The contract's resume request: (DETRACE_RESUME=1, the DETRACE_RESUME_CONTROL negative control or None).
    Malformed values are UsageErrors naming the variable. `framework`: the framework that restores the model itself
    (it refuses the model control, which it cannot apply)."""
    resume = os.environ.get(ENV_RESUME, "")
    if resume not in ("", "0", "1"):
        raise UsageError(f"{ENV_RESUME} must be 1 or 0, not {resume!r}")
    control = os.environ.get(ENV_RESUME_CONTROL) or None
    if control is not None and control not in CONTROLS:
        known = ", ".join(CONTROLS)
        raise UsageError(f"{ENV_RESUME_CONTROL}={control!r} is not a known negative control ({known})")
    if control == MODEL_CONTROL and framework is not None:
        raise UsageError(f"{ENV_RESUME_CONTROL}={control} cannot be applied under {framework}, which restores the "
                         "model itself; the other controls can")
    return resume == "1", control


def resume_source() -> Path | None:
    """The contract's DETRACE_RESUME_FROM: the checkpoint to load at start, or None."""
    text = os.environ.get(ENV_RESUME_FROM)
    return Path(text) if text else None


def stop_requested() -> int | None:
    """The contract's DETRACE_STOP_AT: the step after which to save and stop, or None."""
    return _step_variable(ENV_STOP_AT)


def every_requested() -> int | None:
    """The contract's DETRACE_CKPT_EVERY: save after every K-th step as well (keeping every version), or None."""
    return _step_variable(ENV_CKPT_EVERY)


def check_checkpoint_dir() -> None:
    """At start, when the contract asks for saves (DETRACE_STOP_AT, DETRACE_CKPT_EVERY): DETRACE_CKPT_DIR must be
    a directory this process can write, or create. Else a CheckpointError now, not at the first save, after the
    steps before it were spent."""
    if stop_requested() is None and every_requested() is None:
        return
    directory = checkpoint_dir()
    existing = next(path for path in (directory, *directory.absolute().parents) if path.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"{ENV_CKPT_DIR}={directory} cannot be written ({existing} is not a directory this "
                              "process may write), so the checkpoint the run is asked to save would fail")


def checkpoint_dir() -> Path:
    """The contract's DETRACE_CKPT_DIR (required when stopping or resuming)."""
    directory = os.environ.get(ENV_CKPT_DIR)
    if not directory:
        raise UsageError(f"{ENV_CKPT_DIR} must name the checkpoint directory when stopping or resuming")
    return Path(directory)


def skip_steps_requested() -> tuple[int, int] | None:
    """The contract's DETRACE_SKIP_STEPS=a-b (or a single step a): the global steps whose batches are skipped."""
    text = os.environ.get(ENV_SKIP_STEPS)
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
        raise UsageError(f"{ENV_SKIP_STEPS} must be a global step a or a range a-b with a <= b, not {text!r}")
    first = int(match.group(1))
    return first, int(match.group(2) or first)


def data_shift_requested() -> int | None:
    """The contract's DETRACE_DATA_SHIFT=k: batches the loader advances before the first step this process runs."""
    return _step_variable(ENV_DATA_SHIFT)


def drop_samples_requested() -> frozenset[int]:
    """The contract's DETRACE_DROP_SAMPLES=i,j,...: the dataset indices of the samples never trained on (empty when
    unset)."""
    text = os.environ.get(ENV_DROP_SAMPLES, "")
    items = [item.strip() for item in text.split(",")] if text.strip() else []
    if not all(item.isdigit() for item in items):
        raise UsageError(f"{ENV_DROP_SAMPLES} must be dataset indices separated by commas, such as 3,17, not {text!r}")
    return frozenset(int(item) for item in items)


def restore_part_requested() -> tuple[str, Path] | None:
    """The contract's DETRACE_RESTORE_PART=part:path: (the part of `RESTORE_PARTS`, the checkpoint it comes from),
    or None when unset."""
    text = os.environ.get(ENV_RESTORE_PART)
    if not text:
        return None
    part, sep, path = text.partition(":")
    if not sep or part not in RESTORE_PARTS or not path:
        raise UsageError(f"{ENV_RESTORE_PART} must be PART:PATH, PART one of {', '.join(RESTORE_PARTS)}, "
                         f"not {text!r}")
    return part, Path(path)


def refuse_restore_part_without_resume() -> None:
    """Called where a run has not resumed (TrainState's and the integrations' resume): DETRACE_RESTORE_PART is
    refused in one sentence. Only the resume's load applies it, so a run that does not resume would go on without
    the part it asked for, and `detrace ablate` would take the unchanged run for the part's replay."""
    part = restore_part_requested()
    if part is not None:
        raise UsageError(f"{ENV_RESTORE_PART}={part[0]}:{part[1]} takes a part of the state from a checkpoint "
                         f"when the run resumes, and this run does not ({ENV_RESUME} is not 1 and "
                         f"{ENV_RESUME_FROM} is not set)")


def batches_to_skip(step: int, *, first: bool) -> int:
    """How many batches the loader must drop before it hands out the batch of global step `step`, by the data
    controls; `first`: `step` is the first this process runs (0, or the step it resumed at)."""
    skipped = 0
    shift = data_shift_requested()
    if first and shift is not None:
        skipped += shift
    window = skip_steps_requested()
    if window is not None:
        low, high = window
        # At step a the loader advances past a..b; a process resumed inside the window skips what is left of it.
        if step == low or (first and low < step <= high):
            skipped += high - step + 1
    return skipped
