"""Exact resume: the train state, its checkpoints, and resumable data.

- `TrainState`: model, optimizer, scheduler, grad scaler, every RNG, data position and step, saved with
  torch.distributed.checkpoint (sharded, atomic, pickle-free) under a fingerprint manifest that is verified
  on load; it also implements the DETRACE_CKPT_DIR / DETRACE_STOP_AT / DETRACE_RESUME contract.
- `ResumableSampler`, `ResumableLoader`: a deterministic, resumable data order with per-sample seeded
  worker randomness (`sample_seed`, `SeededDataset`).
- `verify_checkpoint(path)`: the offline check behind `detrace verify-checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from detrace.state.loader import ResumableLoader, ResumableSampler, SeededDataset, sample_seed, seeded_rngs
from detrace.state.train_state import TrainState

if TYPE_CHECKING:
    from detrace.state.manifest import Manifest

__all__ = [
    "ResumableLoader",
    "ResumableSampler",
    "SeededDataset",
    "TrainState",
    "sample_seed",
    "seeded_rngs",
    "verify_checkpoint",
]


def verify_checkpoint(path: str | Path) -> Manifest:
    """Check the checkpoint at `path` (a checkpoint root or one version) against its manifest.

    Returns the manifest (a validated `detrace.state.manifest.Manifest`). Raises CheckpointCorrupted (naming
    the tensor or file) on a mismatch and CheckpointError when there is no readable checkpoint. Not collective:
    this process reads everything.
    """
    from detrace.state import manifest, versions

    return manifest.verify(versions.resolve(Path(path)), collective=False)
