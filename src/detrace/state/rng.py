"""Capture and restore of every random number generator a training step can draw from.

Python's `random`, NumPy's global RandomState, torch's CPU generator, each initialised CUDA device, the
explicit `torch.Generator`s a TrainState is given, and the DTensor RNG tracker where it keeps its own states.
A resume that misses any one of them changes every later dropout mask or augmentation; this is the part
that most trainers get wrong.

The captured state is a tree of tensors and JSON values for `detrace.state.tree` (no pickle).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from detrace._compat import dtensor_rng_states
from detrace.errors import CheckpointError


def capture(generators: Sequence[torch.Generator] = ()) -> dict[str, Any]:
    """The state of every RNG of this process, as tensors and JSON values."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": [int(word) for word in numpy_state["state"]["key"]],
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "generators": [generator.get_state() for generator in generators],
    }
    # Only once CUDA is up: reading a device's generator would otherwise initialise CUDA in a CPU-only run.
    # A process that never initialised CUDA never drew from it, so its (seeded) CUDA state needs no saving.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker_states = dtensor_rng_states()
    if tracker_states:
        state["dtensor"] = {name: tensor.clone() for name, tensor in tracker_states.items()}
    return state


def restore(state: dict[str, Any], generators: Sequence[torch.Generator] = ()) -> None:
    """Put every RNG back to `state` (from `capture`, possibly through a checkpoint)."""
    saved_generators = state["generators"]
    if len(saved_generators) != len(generators):
        raise CheckpointError(
            f"the checkpoint holds {len(saved_generators)} explicit generators, "
            f"this TrainState was given {len(generators)}"
        )
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": np.asarray(numpy_state["key"], dtype=np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    for generator, saved in zip(generators, saved_generators, strict=True):
        generator.set_state(saved)
    if "cuda" in state:
        cuda_states = state["cuda"]
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise CheckpointError(
                f"the checkpoint holds the RNG states of {len(cuda_states)} CUDA devices, this process sees {count}"
            )
        torch.cuda.set_rng_state_all(cuda_states)
    if "dtensor" in state:
        tracker_states = dtensor_rng_states()
        if tracker_states is None or set(tracker_states) != set(state["dtensor"]):
            raise CheckpointError("the checkpoint holds DTensor RNG tracker states this process has no tracker for")
        for name, tensor in state["dtensor"].items():
            tracker_states[name].copy_(tensor)
