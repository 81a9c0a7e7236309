"""Exact, verified resume for a loop written with accelerate, by one registration:

    state = detrace.integrations.accelerate.register(accelerator, data=loader)   # loader: what prepare returned

From then on `accelerator.save_state(path)` also writes a `TrainState` (model, optimizer, scheduler, grad scaler,
every RNG, the data position, the step) with its fingerprint manifest into `path/detrace/`, and
`accelerator.load_state(path)` verifies it and restores it over what accelerate loaded, the RNGs last. What
accelerate's own files miss, and this adds: the position inside an epoch (a prepared DataLoader restarts it, unless
it is stateful, and then it loses its epoch), the DataLoader workers' randomness (the prepared loader given as `data`
loads each sample under its own seed, as a `ResumableLoader` does), verification (a flipped bit is refused naming the
tensor), and each rank's own BatchNorm statistics under DDP. `state.resume_if_requested()` and
`state.end_of_step(step)` give the loop the stop/resume contract of `detrace check-resume` and `detrace locate`
(`detrace.state.contract`), with
`accelerator.save_state` / `load_state` doing the saving and loading, in the transformers layout
(`checkpoint-N/`, detrace's state in `checkpoint-N/detrace/`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from detrace.errors import CheckpointError, UsageError
from detrace.integrations._seeding import make_stateful, seed_samples
from detrace.state import TrainState, rng
from detrace.state.contract import (
    HF_STATE_DIR,
    checkpoint_dir,
    every_requested,
    refuse_restore_part_without_resume,
    resume_requested,
    resume_source,
    saved_versions,
    stop_requested,
)
from detrace.state.train_state import give_own_generator


class AcceleratedState:
    """The `TrainState` that travels with `accelerator.save_state` / `load_state` (made by `register`)."""

    def __init__(self, accelerator: Accelerator, train_state: TrainState) -> None:
        self.accelerator = accelerator
        self.train_state = train_state
        self._loading: Path | None = None
        self._control: str | None = None
        self._fresh_rng: dict[str, Any] | None = None
        accelerator.register_save_state_pre_hook(self._save)
        accelerator.register_load_state_pre_hook(self._before_load)
        # accelerate has no hook after load_state: the TrainState must be restored after what accelerate loads
        # (its RNG states included), so that the verified copy is the one the run goes on with.
        load_state = accelerator.load_state

        @functools.wraps(load_state)
        def load_then_restore(*args: Any, **kwargs: Any) -> Any:
            loaded = load_state(*args, **kwargs)
            self._restore()
            return loaded

        accelerator.load_state = load_then_restore

    @property
    def step(self) -> int:
        """Completed optimizer steps: set by `end_of_step` and by loading."""
        return self.train_state.step

    def resume_if_requested(self) -> int:
        """Under DETRACE_RESUME_FROM (a checkpoint-N) or DETRACE_RESUME=1 (the last checkpoint-N in DETRACE_CKPT_DIR),
        `accelerator.load_state` it; the step to continue from (0 otherwise)."""
        resume, control = resume_requested(framework="accelerate")
        if stop_requested() is not None or every_requested() is not None:
            checkpoint_dir()  # a missing DETRACE_CKPT_DIR is refused now, not after the first step
        source = resume_source()
        if source is None and not resume:
            refuse_restore_part_without_resume()
            return 0
        if source is None:
            root = checkpoint_dir()
            versions = saved_versions(root)
            if not versions:
                raise CheckpointError(f"DETRACE_RESUME=1, but {root} holds no checkpoint-N written with detrace")
            source = versions[max(versions)]
        self._control = control
        try:
            self.accelerator.load_state(str(source))
        finally:
            self._control = None
        return self.train_state.step

    def end_of_step(self, step: int) -> bool:
        """Record that optimizer step `step` (counted from 1) completed; at DETRACE_STOP_AT (and after every
        DETRACE_CKPT_EVERY-th step) `accelerator.save_state` into DETRACE_CKPT_DIR/checkpoint-STEP. True when the
        loop must stop."""
        self.train_state.step = step
        stop, every = stop_requested(), every_requested()
        if step == stop or (every is not None and step % every == 0):
            self.accelerator.save_state(str(checkpoint_dir() / f"checkpoint-{step}"))
        return step == stop

    def _save(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        self.train_state.save(Path(output_dir) / HF_STATE_DIR)

    def _before_load(self, models: list[Any], input_dir: str) -> None:
        directory = Path(input_dir) / HF_STATE_DIR
        if not directory.exists():
            raise CheckpointError(f"{input_dir} holds no detrace state ({HF_STATE_DIR}/): was it saved by an "
                                  "accelerator that detrace.integrations.accelerate.register was called on?")
        self._loading = directory
        if self._control == "skip-rng":
            self._fresh_rng = rng.capture(self.train_state.generators)

    def _restore(self) -> None:
        directory, self._loading = self._loading, None
        if directory is None:  # load_state failed before the pre-hook; accelerate raised already
            return
        self.train_state.load(directory, control=self._control)
        if self._fresh_rng is not None:
            # The skip-rng negative control: accelerate restored its own RNG files meanwhile; undo that too.
            rng.restore(self._fresh_rng, self.train_state.generators)
            self._fresh_rng = None


# How a stream resumes where it stopped (the end of the warning when it cannot).
STREAM_HINT = "; a stream with state_dict() and load_state_dict() (HF datasets' IterableDataset) resumes where it was"


class PreparedLoader:
    """The data position of a DataLoader that accelerate prepared, for the TrainState: the epoch (accelerate's own
    count, which its loader's `state_dict` leaves out) and the position in it (the StatefulDataLoader's state, taken
    when a batch is handed over: accelerate reads one batch ahead)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        position = self.loader.state_dict()
        # Saved after the epoch's last batch, the loader resumes with the next epoch, which accelerate counts only
        # once the loop asks past that batch.
        epoch = self.loader.iteration + (1 if position.get("_iterator_finished") else 0)
        return {"epoch": epoch, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.iteration = state["epoch"]
        self.loader.load_state_dict(state["position"])


def _prepared(loader: Any) -> PreparedLoader:
    """accelerate's prepared DataLoader, as it is (with `use_stateful_dataloader` or without), made to resume at its
    position: read through a StatefulDataLoader of its settings, each sample loaded under its own seed and the
    epoch's order pinned (as the transformers callback does; `detrace.integrations._seeding`)."""
    if not hasattr(loader, "iteration"):
        raise UsageError(f"detrace.integrations.accelerate.register takes a DataLoader that accelerator.prepare "
                         f"returned, or one with state_dict() and load_state_dict(), not {type(loader).__name__}")
    # Seeded first: a StatefulDataLoader copies the dataset into its workers when it makes an iterator, and taking
    # its state makes one.
    keys = seed_samples(loader, seed=torch.initial_seed(), framework="accelerate", hint=STREAM_HINT)
    if keys is not None:
        keys.follows_set_epoch = True  # accelerate sets each epoch's number on its samplers as the epoch starts
        keys.epoch = loader.iteration
        keys.pin_order()
    if getattr(loader, "use_stateful_dataloader", False):
        # accelerate took the state of the loader it built (its snapshot before the first batch), which made an
        # iterator, workers started, from the dataset as it was: dropped, so that the first epoch starts a new one.
        loader.base_dataloader.load_state_dict({})
    else:
        try:
            make_stateful(loader)
        except ImportError:
            raise UsageError("resuming accelerate's prepared DataLoader at its position needs torchdata's "
                             "StatefulDataLoader: pip install torchdata") from None
    give_own_generator(loader.base_dataloader)
    return PreparedLoader(loader)


def register(accelerator: Accelerator, *, data: Any = None, generators: Sequence[torch.Generator] = (),
             extra: dict[str, Any] | None = None) -> AcceleratedState:
    """Make `accelerator.save_state` / `load_state` carry a verified `TrainState` of what it prepared (one model,
    at most one optimizer and one LR scheduler) and of `data` (the data position: the DataLoader that
    `accelerator.prepare` returned, a `ResumableLoader`, a torchdata `StatefulDataLoader`, ...), `generators` and
    `extra` (as `TrainState` takes them).

    A prepared DataLoader is taken as it is, with accelerate's `use_stateful_dataloader` or without: it is read
    through torchdata's `StatefulDataLoader` (built with its settings where accelerate built a plain one), each
    sample is loaded under its own seed (from `torch.initial_seed()`, as `accelerate.utils.set_seed` sets it), and
    it resumes at its epoch and position.

    Call it after `accelerator.prepare` and before the first training step: the TrainState pins DDP's bucket
    layout for the whole run (see docs/resume.md)."""
    if not isinstance(accelerator, Accelerator):
        raise UsageError(f"detrace.integrations.accelerate.register needs the Accelerator, not "
                         f"{type(accelerator).__name__}")
    # accelerate keeps what it prepared in these lists (save_state reads them the same way).
    models, optimizers, schedulers = accelerator._models, accelerator._optimizers, accelerator._schedulers
    if len(models) != 1 or len(optimizers) > 1 or len(schedulers) > 1:
        raise UsageError(
            f"detrace.integrations.accelerate.register needs one prepared model and at most one optimizer and one "
            f"LR scheduler (call it after accelerator.prepare); this accelerator holds {len(models)} models, "
            f"{len(optimizers)} optimizers and {len(schedulers)} schedulers")
    train_state = TrainState(
        model=models[0],
        optimizer=optimizers[0].optimizer if optimizers else None,  # AcceleratedOptimizer wraps it
        scheduler=schedulers[0].scheduler if schedulers else None,  # AcceleratedScheduler wraps it
        scaler=accelerator.scaler,
        data=_prepared(data) if getattr(data, "base_dataloader", None) is not None else data,
        generators=generators,
        extra=extra,
    )
    return AcceleratedState(accelerator, train_state)
