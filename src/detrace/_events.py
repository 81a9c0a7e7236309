"""Events one part of detrace announces and another, optional part listens to, so that neither imports the other.

The checkpoint side (detrace.state) must work without the tracer, and the tracer must not load the checkpoint code:
the announcer calls the listeners registered here, and a part that is never imported never registers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

step_restored: list[Callable[[int], None]] = []
"""Called with `n` when a training state was restored from a checkpoint taken after step n-1 (TrainState.load):
a recording tracer counts steps on from n (detrace.record registers `set_step` when imported)."""


def restored(step: int) -> None:
    """Announce that training resumes at `step`."""
    for listener in step_restored:
        listener(step)


restore_running: list[Callable[[bool], None]] = []
"""Called with True when a training state starts to be restored and with False when it is done: while it runs, a
tracer does not take the restored optimizer's step count for the step (TrainState gives the step itself, once
everything is restored, so what the restore records stays with the set-up, in no training step)."""


checkpoint_running: list[Callable[[bool], None]] = []
"""Called with True when a checkpoint starts to be saved or loaded and with False when it is done: a tracer records
what runs meanwhile (DCP's own collectives, the manifest's fingerprints) in phase "checkpoint", apart from the
training (detrace.record registers its listener when imported)."""


@contextlib.contextmanager
def checkpoint_io() -> Iterator[None]:
    """Announce a checkpoint save or load around the block."""
    for listener in checkpoint_running:
        listener(True)
    try:
        yield
    finally:
        for listener in checkpoint_running:
            listener(False)


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """Announce a restore around the block."""
    for listener in restore_running:
        listener(True)
    try:
        yield
    finally:
        for listener in restore_running:
            listener(False)


recording = False
"""True while a tracer records in this process (detrace.record sets it as its tracer starts and clears it as it
stops): a sampler keeps its batches' sample indices for `sample_source` only then."""

sample_source: list[Callable[[], list[int] | None]] = []
"""At most one: returns the dataset indices of the samples of the next batch the training loop takes (None when it
does not know them). Detrace's data handling of a framework's loader registers it (detrace.integrations._seeding);
the tracer's batch rung takes one batch per training forward and records it with the batch."""


trained_from: list[Callable[[], list[int] | None] | None] = []
"""Empty before the first training forward; then one item: the source the last one took its batch's indices from
(None when there was none; see `next_samples`)."""


def next_samples() -> list[int] | None:
    """The sample indices of the batch the training's forward about to run takes, when a sampler knows them."""
    trained_from[:] = [sample_source[0] if sample_source else None]
    return sample_source[0]() if sample_source else None
