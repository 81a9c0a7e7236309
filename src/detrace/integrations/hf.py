"""Exact resume and tracing for transformers' `Trainer`: `Trainer(..., callbacks=[DetraceCallback()])`.

What HF restores by itself from `checkpoint-N`: the model, optimizer, LR scheduler, grad scaler, the global
RNG states and the data position (it skips the batches already trained in the epoch). What it misses, and
this callback adds:

- dataset-side randomness: a sample's augmentation comes from the RNG of whichever DataLoader worker loads
  it (another worker, at another point of its stream, after a mid-epoch resume) or, with no workers, from
  the main RNG before HF has restored it. Each sample is loaded under its own seed instead
  (`detrace.integrations._seeding`), so its randomness no longer depends on workers or on the resume;
- the order of an epoch when accelerate's seedable sampler is turned off (pinned to `seed + epoch`);
- a stream's position: an `IterableDataset` that can say where it is (with `state_dict` / `load_state_dict`, such
  as HF `datasets`' IterableDataset; needs torchdata) is read through torchdata's `StatefulDataLoader`, whose state
  is saved with the checkpoint and restored on resume, where HF alone would replay the stream from its start to
  skip what was trained;
- verification: a detrace checkpoint (`TrainState`) beside HF's files in `checkpoint-N/detrace/`, with the
  fingerprint manifest of every tensor, is verified on resume and restored over what HF loaded; a flipped bit
  is refused by tensor name;
- the stop/resume contract of `detrace check-resume` and `detrace locate` (`detrace.state.contract`), the
  global step and HF's logged metrics for the tracer.

Importing this module also registers detrace's fixed-order MoE experts in transformers' `ExpertsInterface` as
"detrace" (`config._experts_implementation = "detrace"`; see docs/kernels.md), where transformers has it (5 and up).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from detrace import record as tracing
from detrace.errors import CheckpointError, UsageError
from detrace.integrations._seeding import resumable_stream, seed_samples, skip_for_controls
from detrace.ops import hf_experts as experts
from detrace.state import TrainState, rng
from detrace.state.contract import (
    HF_STATE_DIR,
    checkpoint_dir,
    every_requested,
    refuse_restore_part_without_resume,
    resume_requested,
    resume_source,
    stop_requested,
)
from detrace.state.sample_keys import SampleKeys

if importlib.util.find_spec("transformers.integrations.moe") is not None:
    experts.register()

# How an IterableDataset's stream resumes where it stopped (the end of the warning when it cannot).
STREAM_HINT = ("; a stream with state_dict() and load_state_dict() (such as HF datasets' IterableDataset) resumes "
               "where it stopped, with torchdata installed")

# HF's logged metrics, fed to the tracer under these names (the metrics rung records its own "loss").
LOGGED = {"loss": "hf/loss", "grad_norm": "hf/grad_norm", "learning_rate": "hf/learning_rate"}


class DetraceCallback(TrainerCallback):
    """Bit-exact resume from any `checkpoint-N`, a verified checkpoint, and the tracer's steps and metrics.

    Args:
        deterministic: apply `detrace.deterministic(args.seed)` when training starts.
        strict: passed to `detrace.deterministic` (an op without a deterministic implementation raises).
    """

    def __init__(self, *, deterministic: bool = False, strict: bool = True) -> None:
        self.deterministic = deterministic
        self.strict = strict
        self._state: TrainState | None = None
        self._keys: SampleKeys | None = None
        self._stop_at: int | None = None
        self._every: int | None = None
        self._resume = False
        self._control: str | None = None
        self._fresh_rng: dict[str, Any] | None = None

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Read the stop/resume contract: a stopping (or periodically saving) run checkpoints into
        DETRACE_CKPT_DIR; a resuming one names its checkpoint in `args.resume_from_checkpoint`, which the script
        hands to `train()`."""
        self._resume, self._control = resume_requested(framework="the transformers Trainer")
        self._stop_at = stop_requested()
        self._every = every_requested()
        if self._stop_at is not None or self._every is not None:
            args.output_dir = str(checkpoint_dir())
        if self._every is not None:
            args.save_total_limit = None  # keep every version: `detrace locate` resumes from any of them
        source = resume_source()
        if source is not None:
            # A checkpoint-N, or a directory of them (the last one).
            own = source / "trainer_state.json"
            found = str(source) if own.is_file() else get_last_checkpoint(str(source)) if source.is_dir() else None
            if found is None:
                raise CheckpointError(f"DETRACE_RESUME_FROM={source} is neither an HF checkpoint-N nor a directory "
                                      "that holds one")
            args.resume_from_checkpoint = found
            self._resume = True
        elif self._resume:
            root = checkpoint_dir()
            last = get_last_checkpoint(str(root)) if root.is_dir() else None
            if last is None:
                raise CheckpointError(f"DETRACE_RESUME=1, but {root} holds no HF checkpoint-N")
            args.resume_from_checkpoint = last
        if self._control == "skip-data":
            args.ignore_data_skip = True  # the negative control: start the resumed epoch from its first batch

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                       model: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if self.deterministic:
            import detrace

            detrace.deterministic(args.seed, strict=self.strict)
        seed = args.data_seed if args.data_seed is not None else args.seed
        stream = resumable_stream(train_dataloader)
        self._keys = None if stream is not None else seed_samples(
            train_dataloader, seed=seed, framework="transformers Trainer", hint=STREAM_HINT, record=True)
        self._state = TrainState(
            model=model,
            optimizer=getattr(optimizer, "optimizer", optimizer),  # accelerate's AcceleratedOptimizer wraps it
            scheduler=lr_scheduler,
            scaler=getattr(optimizer, "scaler", None),
            data=stream,
            extra={"trainer": _position(state)},
        )
        if state.global_step > 0:
            self._load(args, state)
            if stream is not None:
                # The stream goes on from the position just restored; HF would otherwise replay it from its start
                # to skip the batches already trained (read before the epoch's first batch, so set in time).
                args.ignore_data_skip = True
                if self._fresh_rng is None:
                    # Starting the stream's iterator draws its base seed from the global RNG, which the run that
                    # never stopped did at the epoch's start: the first step starts from the restored states again.
                    self._fresh_rng = rng.capture()
        elif self._resume:
            raise UsageError(
                "DETRACE_RESUME=1, but the Trainer started from step 0: pass the checkpoint on, as in "
                "trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)"
            )
        else:  # here, not at on_init_end: a script may resume by itself, in train(resume_from_checkpoint=...)
            refuse_restore_part_without_resume()
        batch = getattr(train_dataloader, "batch_size", None) or args.per_device_train_batch_size
        samples_per_step = batch * args.gradient_accumulation_steps
        skip_for_controls(self._keys, state.global_step, samples_per_step, framework="transformers")
        if self._keys is None:  # a stream: no sample index to skip by or to record
            return
        steps_per_epoch = -(-len(train_dataloader) // args.gradient_accumulation_steps)
        if not args.ignore_data_skip:
            # HF draws the batches its resumed epoch already trained and drops them (skip_first_batches).
            self._keys.unseen = state.global_step % steps_per_epoch * args.gradient_accumulation_steps
        if self._keys.skip:
            # HF ends training at an epoch that yields no batch: a variant would stop short of the steps it must run.
            left = len(self._keys) - state.global_step % steps_per_epoch * samples_per_step
            if self._keys.skip >= left:
                raise UsageError(
                    f"the resume contract's data controls skip {self._keys.skip} samples from step "
                    f"{state.global_step}, past the end of its epoch ({left} samples left), where the transformers "
                    "Trainer would stop training: resume from a checkpoint earlier in the epoch, or skip fewer steps")

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._keys is not None:
            # HF's epoch counter: `state.epoch` is a whole number exactly at an epoch's end.
            self._keys.epoch = int(state.epoch or 0)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._fresh_rng is not None:
            # The skip-rng control: HF restored its own RNG file meanwhile; undo that too. Or a resumed stream: see
            # on_train_begin.
            rng.restore(self._fresh_rng)
            self._fresh_rng = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        tracing.set_step(state.global_step, source="hf")
        if self._every is not None and state.global_step % self._every == 0:
            control.should_save = True
        if state.global_step == self._stop_at:
            control.should_save = True
            control.should_training_stop = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        _record(logs or {})

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if self._state is None:
            return
        self._state.extra["trainer"] = _position(state)
        self._state.step = state.global_step
        self._state.save(Path(args.output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / HF_STATE_DIR)

    def _load(self, args: TrainingArguments, state: TrainerState) -> None:
        """HF resumed from a checkpoint: verify detrace's state beside it and restore it over HF's."""
        assert self._state is not None
        candidates = [Path(args.output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / HF_STATE_DIR]
        if args.resume_from_checkpoint:
            candidates.insert(0, Path(args.resume_from_checkpoint) / HF_STATE_DIR)
        directory = next((path for path in candidates if path.exists()), None)
        if directory is None:
            places = " or ".join(str(path) for path in candidates)
            raise CheckpointError(
                f"the Trainer resumed at step {state.global_step}, but there is no detrace state in {places}: "
                "was the checkpoint written with DetraceCallback (and, when it is not in output_dir, named in "
                "args.resume_from_checkpoint)?"
            )
        if self._control == "skip-rng":
            self._fresh_rng = rng.capture()
        self._state.load(directory, control=self._control)
        saved = self._state.extra["trainer"]
        if saved != _position(state):
            raise CheckpointError(
                f"{directory} was saved at global step {saved['global_step']}, and HF resumed at {state.global_step}"
            )


def _position(state: TrainerState) -> dict[str, Any]:
    return {"global_step": state.global_step}


def _record(logs: dict[str, Any]) -> None:
    for name, traced in LOGGED.items():
        if isinstance(logs.get(name), (int, float)):
            tracing.metric(traced, logs[name])
