"""Exact resume and tracing for Lightning's `Trainer`: `Trainer(..., callbacks=[DetraceCallback()])`.

What Lightning restores by itself from a `.ckpt`: the model, optimizers, LR schedulers, precision plugin
(grad scaler) and its loops' progress (epoch, global step, batches done). What it misses, and this callback
adds:

- every RNG (Python, NumPy, torch CPU and CUDA): Lightning saves none, so dropout after a resume draws from
  the fresh process's state;
- the data position inside an epoch: a DataLoader without `state_dict` restarts the epoch from its first
  batch (Lightning warns); the callback skips the batches already trained;
- dataset-side randomness and the epoch's order: each sample is loaded under its own seed and a shuffling
  sampler's order is pinned to `seed + epoch` (`detrace.integrations._seeding`);
- verification: a detrace checkpoint (`TrainState`) beside each `.ckpt`, in `<file>.ckpt.detrace/`, with the
  fingerprint manifest of every tensor, verified on resume and restored over what Lightning loaded;
- the validation loop on the side: the global RNGs are as it found them when it ends (its DataLoader draws a
  seed from them after the step's checkpoint was taken, which a resumed run never does), and what it logged is
  the evaluation's, not the next training step's metrics;
- the stop/resume contract of `detrace check-resume` and `detrace locate` (`detrace.state.contract`), the
  global step and the step's logged metrics for the tracer.

It runs in one process and under `strategy="ddp"` whose processes run the script (torchrun, or Lightning's own
launch): there every rank writes its part of the TrainState (Lightning writes its file on rank 0 only), each rank's
shard of the DistributedSampler is seeded per sample, and DDP's bucket layout is pinned. Other strategies are
refused under the contract and otherwise left alone (`_unsupported`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
except ImportError:  # the standalone package
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.io import CheckpointIO
    from pytorch_lightning.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        SingleDeviceStrategy,
        Strategy,
    )

import torch
from torch.nn.parallel import DistributedDataParallel

from detrace import record as tracing
from detrace.errors import CheckpointError, UsageError
from detrace.integrations._seeding import seed_samples, skip_for_controls
from detrace.state import TrainState, rng
from detrace.state.buckets import pin_layout
from detrace.state.contract import (
    LIGHTNING_STATE_SUFFIX,
    checkpoint_dir,
    every_requested,
    lightning_checkpoint,
    refuse_restore_part_without_resume,
    resume_requested,
    resume_source,
    stop_requested,
)
from detrace.state.sample_keys import SampleKeys


class DetraceCallback(pl.Callback):
    """Bit-exact resume from a Lightning checkpoint, a verified checkpoint, and the tracer's steps and metrics.

    Args:
        deterministic: apply `detrace.deterministic(seed)` when fitting starts.
        seed: the seed of `deterministic` and of the samples' randomness; by default the one
            `lightning.seed_everything` set (PL_GLOBAL_SEED), else 0.
        strict: passed to `detrace.deterministic`.
    """

    def __init__(self, *, deterministic: bool = False, seed: int | None = None, strict: bool = True) -> None:
        self.deterministic = deterministic
        self.seed = seed
        self.strict = strict
        self._resume, self._control = resume_requested(framework="Lightning")
        self._source = resume_source()
        self._resume = self._resume or self._source is not None
        self._stop_at = stop_requested()
        self._every = every_requested()
        # The global step at the previous batch's end: a step completes at the batch that advances it.
        self._seen_step = 0
        self._resumed_from: Path | None = None
        self._trainer: pl.Trainer | None = None
        self._state: TrainState | None = None
        self._keys: SampleKeys | None = None
        self._rng_before_data: dict[str, Any] | None = None
        self._inactive = False
        """Set where the integration does not support the strategy: the run trains without it."""
        self._before_validation: dict[str, Any] = {}
        self._rng_before_validation: dict[str, Any] | None = None
        self._validation_metrics: set[str] = set()
        """Names the validation loop logged: they are the evaluation's, never a training step's metrics (a resumed
        run that has not validated yet holds none of them)."""

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint to resume from under the stop/resume contract (DETRACE_RESUME_FROM, else the last one
        in DETRACE_CKPT_DIR when DETRACE_RESUME=1), else None. The callback resumes from it by itself; passing it
        to `trainer.fit(..., ckpt_path=...)` is allowed too."""
        if not self._resume:
            return None
        if self._source is not None and not self._source.is_dir():
            if not self._source.is_file():
                raise CheckpointError(f"DETRACE_RESUME_FROM={self._source}, but there is no such checkpoint")
            return str(self._source)
        root = self._source or checkpoint_dir()
        saved = sorted(root.glob("step-*.ckpt")) if root.is_dir() else []
        if not saved:
            raise CheckpointError(f"{'DETRACE_RESUME_FROM' if self._source else 'DETRACE_RESUME=1'}, but {root} "
                                  "holds no Lightning checkpoint (step-*.ckpt)")
        return str(saved[-1])

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.deterministic:
            import detrace

            detrace.deterministic(self._seed(), strict=self.strict)
        unsupported = _unsupported(trainer.strategy)
        if unsupported is not None:
            self._step_aside(trainer, unsupported)
            return
        self._trainer = trainer
        # Lightning reads and writes every checkpoint through this plugin: the place to learn the paths.
        if not isinstance(trainer.strategy.checkpoint_io, _BesideCheckpoints):
            trainer.strategy.checkpoint_io = _BesideCheckpoints(trainer.strategy.checkpoint_io, self)
        if not isinstance(vars(trainer.strategy).get("save_checkpoint"), _SaveOnEveryRank):
            # on purpose: an instance attribute wraps the strategy's method
            trainer.strategy.save_checkpoint = _SaveOnEveryRank(
                trainer.strategy.save_checkpoint, self)
        if self._resume:
            self._preload(trainer)

    def _step_aside(self, trainer: pl.Trainer, why: str) -> None:
        """A strategy the integration does not support (`why` says which and why): a run under the stop/resume
        contract is refused in one sentence (a SystemExit: no traceback, on every rank); any other run trains
        on, as it would without detrace's resume, after one warning (from rank 0)."""
        if self._resume or self._stop_at is not None or self._every is not None:
            raise SystemExit(f"detrace: the Lightning integration cannot stop, save or resume this run: {why}")
        self._inactive = True
        text = f"detrace's Lightning integration leaves this run alone (no resume, no data seeding): {why}"
        tracing.warned(text)
        if trainer.is_global_zero:
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def _preload(self, trainer: pl.Trainer) -> None:
        """Make a `fit` that was given no `ckpt_path` resume from the contract's checkpoint.

        Lightning picks its checkpoint in `fit`, before any callback hook runs, and restores it right after
        the `setup` and `configure_model` hooks from what its checkpoint connector has loaded. Loading ours
        into the connector here lets Lightning restore everything (model, optimizer, scheduler, precision,
        loops, callbacks) in its own order; a `ckpt_path` given to `fit` still takes precedence.
        """
        # The connector is Lightning's own (not public API): its `resume_start` has loaded checkpoints since 2.0.
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not callable(getattr(connector, "resume_start", None)):
            raise UsageError("this Lightning version cannot be resumed by a callback alone: pass the checkpoint "
                             "on, as in trainer.fit(model, data, ckpt_path=callback.ckpt_path)")
        connector.resume_start(self.ckpt_path)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rng_before_data = rng.capture()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._inactive:
            return
        # Lightning started the epoch's DataLoader iterator before this hook, and its first batch may have drawn
        # from the main RNG (a RandomSampler's order, the augmentation with no workers): that iterator is
        # replaced below, and its draws are undone here.
        if self._rng_before_data is not None:
            rng.restore(self._rng_before_data)
            self._rng_before_data = None
        loader = trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise UsageError("detrace's Lightning integration needs one torch DataLoader for training, "
                             f"not {type(loader).__name__}")
        self._keys = seed_samples(loader, seed=self._seed(), framework="Lightning Trainer", record=True)
        if self._keys is not None:
            self._keys.epoch = trainer.current_epoch
        if loader.generator is None:
            # Starting an epoch's workers would otherwise draw their base seed from the global torch RNG.
            loader.generator = torch.Generator().manual_seed(self._seed())
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise UsageError("detrace's Lightning integration supports one optimizer and at most one LR scheduler")
        schedulers = trainer.lr_scheduler_configs
        self._state = TrainState(
            model=pl_module,
            optimizer=trainer.optimizers[0],
            scheduler=schedulers[0].scheduler if schedulers else None,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            extra={"loop": _position(trainer)},
        )
        # Lightning's DDP wraps the module in a wrapper of its own before DDP: TrainState's own pinning looks for a
        # DDP around `pl_module` and would not find it, so the DDP module is pinned here, before its first step.
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            pin_layout(trainer.strategy.model)
        self._seen_step = trainer.global_step
        if self._resumed_from is not None:
            self._load(trainer, loader)
        elif self._resume:
            raise UsageError("DETRACE_RESUME=1, but the Trainer did not resume: pass the checkpoint on, as in "
                             "trainer.fit(model, data, ckpt_path=callback.ckpt_path)")
        else:  # here, not in __init__: a script may resume by itself, in fit(ckpt_path=...)
            refuse_restore_part_without_resume()
        skip_for_controls(self._keys, trainer.global_step,
                          (loader.batch_size or 1) * trainer.accumulate_grad_batches, framework="Lightning")
        # Start the epoch's DataLoader iterator again, so that its batches come through the seeded sampler from
        # the position just restored.
        fetcher = trainer.fit_loop._data_fetcher
        assert fetcher is not None  # the fit loop made it before on_train_start
        iter(fetcher)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._keys is not None:
            self._keys.epoch = trainer.current_epoch

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._before_validation = dict(trainer.callback_metrics)
        # The validation loop draws from the global RNGs (its DataLoader iterator's base seed, at least) after the
        # step's checkpoint was taken: a resumed run, which has not validated there, would draw the next steps'
        # dropout from other states. The training's random streams are left as if the validation had not run.
        self._rng_before_validation = rng.capture()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng_before_validation is not None:
            rng.restore(self._rng_before_validation)
            self._rng_before_validation = None
        # What the validation loop logged, recorded in its evaluation phase (the tracer is still in it).
        for name, value in trainer.callback_metrics.items():
            if value is not self._before_validation.get(name):
                self._validation_metrics.add(name)
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    tracing.metric(f"lightning/{name}", value)
        self._before_validation = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Inside the optimizer step (Lightning runs the training step in its closure): the step's own records.
        for name, value in trainer.callback_metrics.items():
            if (not name.endswith("_epoch") and name not in self._validation_metrics
                    and isinstance(value, torch.Tensor) and value.numel() == 1):
                tracing.metric(f"lightning/{name}", value)
        tracing.metric("lightning/lr", float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        tracing.set_step(trainer.global_step, source="lightning")
        step, advanced = trainer.global_step, trainer.global_step != self._seen_step
        self._seen_step = step
        if not advanced:  # inside a gradient-accumulation cycle: no optimizer step completed with this batch
            return
        periodic = self._every is not None and step % self._every == 0
        if step == self._stop_at or periodic:
            # Each version is its own file: `detrace locate` resumes from any of them.
            trainer.save_checkpoint(lightning_checkpoint(checkpoint_dir(), step))
        if step == self._stop_at:
            trainer.should_stop = True

    def _seed(self) -> int:
        return self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", "0"))

    def _save(self, path: Path) -> None:
        if self._state is None or self._trainer is None:  # before training started there is nothing to add
            return
        self._state.extra["loop"] = _position(self._trainer)
        self._state.step = self._trainer.global_step
        self._state.save(Path(f"{path}{LIGHTNING_STATE_SUFFIX}"))

    def _load(self, trainer: pl.Trainer, loader: torch.utils.data.DataLoader) -> None:
        """Lightning resumed from `self._resumed_from`: verify detrace's state beside it, restore it over
        Lightning's, and skip the batches of the current epoch that were already trained."""
        assert self._state is not None and self._resumed_from is not None
        directory = Path(f"{self._resumed_from}{LIGHTNING_STATE_SUFFIX}")
        if not directory.exists():
            raise CheckpointError(f"Lightning resumed from {self._resumed_from}, but there is no detrace state in "
                                  f"{directory}: was the checkpoint written with DetraceCallback?")
        self._state.load(directory, control=self._control)
        if self._state.extra["loop"] != _position(trainer):
            raise CheckpointError(f"{directory} was saved at {self._state.extra['loop']}, and Lightning resumed at "
                                  f"{_position(trainer)}")
        # Batches handed to the training step in this epoch (a checkpoint at on_train_batch_end counts its batch
        # as processed, not yet as completed).
        # `current` is annotated as the base tracker; at run time it is a _ProcessedTracker, which has `processed`
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if self._keys is not None and self._control != "skip-data" and done < trainer.num_training_batches:
            # (else the epoch is over, or the data is a stream that detrace leaves alone)
            self._keys.skip = done * (loader.batch_size or 1)


class _BesideCheckpoints(CheckpointIO):
    """Lightning's checkpoint I/O, with the path of the checkpoint being resumed noted for the callback (every rank
    loads), and detrace's state beside a checkpoint removed with it (rank 0 removes)."""

    def __init__(self, inner: CheckpointIO, callback: DetraceCallback) -> None:
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        self.callback._resumed_from = Path(path)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        shutil.rmtree(f"{path}{LIGHTNING_STATE_SUFFIX}", ignore_errors=True)

    def teardown(self) -> None:
        self.inner.teardown()


class _SaveOnEveryRank:
    """The strategy's `save_checkpoint`, followed on every rank by detrace's state beside the file.

    Lightning's strategies write the checkpoint file on rank 0 only, but every rank calls `save_checkpoint`
    (`Trainer.save_checkpoint` must run on all of them). detrace's `TrainState` is written by every rank together:
    each its own RNG states and data position, and DCP for the model and optimizer (a collective). So the
    strategy's method is wrapped on the strategy instance rather than the rank-0-only checkpoint I/O plugin."""

    def __init__(self, save: Any, callback: DetraceCallback) -> None:
        self.save = save
        self.callback = callback

    def __call__(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.save(checkpoint, filepath, storage_options=storage_options)
        self.callback._save(Path(filepath))


def _unsupported(strategy: Strategy) -> str | None:
    """Why the integration cannot make a run of `strategy` exact (one clause), or None: it supports one process
    and DDP whose processes run the script (torchrun, or Lightning's own launch of `strategy="ddp"`)."""
    name = type(strategy).__name__
    if isinstance(strategy, SingleDeviceStrategy):
        return None
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):
        # Not public: DDPStrategy keeps the start method it was given ("popen" is strategy="ddp").
        method = getattr(strategy, "_start_method", "popen")
        if method == "popen":
            return None
        return (f"strategy='ddp' starts its processes by running the script again (torchrun, or Lightning's own "
                f"launch), but this {name} starts them with multiprocessing ({method}); use strategy='ddp'")
    return f"it supports one process and strategy='ddp', not {name}"


def _position(trainer: pl.Trainer) -> dict[str, int]:
    # Not the epoch: Lightning counts a checkpoint taken after an epoch's last batch in the next epoch on resume.
    return {"global_step": trainer.global_step}
