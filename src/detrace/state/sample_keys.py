"""The sample keys of a DataLoader that a framework built: its index sampler's indices as `(index, sample seed)`
pairs, the seed of each sample's randomness (`detrace.state.loader.sample_seed`) for the epoch.

The framework integrations put `SampleKeys` in place of the loader's index sampler
(`detrace.integrations._seeding.seed_samples`); `detrace audit` recognises it as a pinned order. It describes the
data, as `ResumableLoader` does, so it lives here rather than in the integrations, which also import the tracer.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch
from torch.utils.data import RandomSampler, Sampler

from detrace import _events
from detrace.state.contract import drop_samples_requested
from detrace.state.loader import PENDING_BATCHES, sample_seed


class SampleKeys(Sampler[tuple[int, int]]):
    """Yields the wrapped sampler's indices as `(index, sample seed)` keys of the current `epoch`, leaving out the
    indices of the resume contract's DETRACE_DROP_SAMPLES.

    While a tracer records, it also groups the indices it hands out into the loader's batches (`batching`), in
    order, for the tracer's batch rung (`_events.sample_source`): the loader may prefetch, but it hands its batches
    to the training loop in the order the sampler filled them, one per training forward."""

    def __init__(self, sampler: Sampler[int], *, seed: int) -> None:
        self.sampler = sampler
        self.seed = seed
        self.epoch = 0
        """Set by the integration at each epoch start, from the framework's own epoch count."""
        self.skip = 0
        """Samples of the epoch that the next iteration leaves out (a framework that does not skip the batches
        already trained when it resumes mid-epoch); back to 0 once used."""
        self.follows_set_epoch = False
        """Set where no framework hook sets `epoch`: `set_epoch` (what accelerate's DataLoader calls as each epoch
        starts, with its own count) sets it."""
        self.batching: tuple[int, bool] | None = None
        """The loader's batch size and drop_last, when its batch sampler says them: the sample indices of each batch
        are then kept for the tracer."""
        self.unseen = 0
        """Batches the framework's loop draws at the next iteration and discards without training on them (HF's
        skip of the batches a resumed epoch already trained): they are not kept for the tracer."""
        self._batches: collections.deque[list[int]] = collections.deque(maxlen=PENDING_BATCHES)
        # A plain RandomSampler without a generator draws its order from the global torch RNG when an epoch
        # starts: a run resumed mid-epoch would draw it from another state than the run that never stopped.
        self._pin_order = (
            isinstance(sampler, RandomSampler) and sampler.generator is None and not hasattr(sampler, "set_epoch")
        )

    def pin_order(self) -> None:
        """Order each epoch from `seed + epoch` also where the `RandomSampler` has a generator of its own (accelerate
        gives it one, whose state its loader does not save: a loader resumed mid-epoch would replay the epoch's order
        from the generator's state after it)."""
        self._pin_order = isinstance(self.sampler, RandomSampler) and not hasattr(self.sampler, "set_epoch")

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        if self._pin_order:
            self.sampler.generator = torch.Generator().manual_seed(self.seed + epoch)  # type: ignore[attr-defined]
        skip, self.skip = self.skip, 0
        unseen, self.unseen = self.unseen, 0
        dropped = drop_samples_requested()
        # A new iteration: batches an abandoned iterator prefetched never reach the training loop.
        self._batches.clear()
        size, keep_last = self.batching if self.batching is not None and _events.recording else (0, False)
        if size:
            _events.sample_source[:] = [self._next_batch]
        batch: list[int] = []
        for position, index in enumerate(self.sampler):
            if position < skip or index in dropped:
                continue
            if size:
                batch.append(index)
                if len(batch) == size:
                    if unseen:
                        unseen -= 1
                    else:
                        self._batches.append(batch)
                    batch = []
            yield index, sample_seed(self.seed, epoch, index)
        if batch and not keep_last:
            self._batches.append(batch)

    def _next_batch(self) -> list[int] | None:
        """The sample indices of the oldest batch handed out and not yet taken by a training forward."""
        return self._batches.popleft() if self._batches else None

    def __len__(self) -> int:
        """The whole epoch's length, also while skipping: the framework counts the skipped batches itself."""
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped sampler (accelerate's seedable sampler orders each epoch by it)."""
        if self.follows_set_epoch:
            self.epoch = epoch
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
