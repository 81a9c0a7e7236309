"""Resumable, deterministic data order and per-sample seeded randomness for DataLoader workers.

Two things decide which bits a batch has: which samples it holds (the sampler's order and position) and
what random augmentation they got. A plain DataLoader resumes neither exactly: the sampler restarts its
epoch, and worker RNGs are seeded per worker at iterator start, so after a mid-epoch restart each sample
lands on another worker, at another point of that worker's random stream.

Here the order is a pure function of (seed, epoch, rank) and the position counts samples handed to the
training loop (not the ones DataLoader prefetched). Each sample's randomness is seeded from
(seed, epoch, sample index) right before it is loaded, so it is the same on whichever worker, in whichever
process, with any `num_workers`: a resumed epoch gets exactly the augmentations the continuous one got.
"""

from __future__ import annotations

import collections
import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from detrace import _events
from detrace.errors import CheckpointError, UsageError
from detrace.state.contract import drop_samples_requested

PENDING_BATCHES = 1024
"""The most batches of sample indices kept for the tracer: far more than a loop holds before its forward (a loop
that takes batches otherwise than through a traced forward keeps the newest only)."""


class ResumableSampler(Sampler[int]):
    """A deterministic sampler whose state (epoch, position) can be saved and restored.

    Like `torch.utils.data.DistributedSampler`: each epoch's order is a permutation drawn from
    `seed + epoch`, padded (or, with `drop_last`, cut) to a multiple of `num_replicas`, and rank `r` takes
    every `num_replicas`-th index from `r`. Iterating it yields the rest of the current epoch from
    `position`, advancing `position` as indices are handed out, and moves to the next epoch at its end.
    Inside a DataLoader that prefetches, let `ResumableLoader` (or torchdata's StatefulDataLoader) count
    what the training loop consumed instead.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 1:
            raise UsageError(f"num_samples must be positive, not {num_samples}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise UsageError(f"rank {rank} is not one of num_replicas={num_replicas} replicas")
        if drop_last and num_samples < num_replicas:
            raise UsageError(f"with drop_last, {num_samples} samples leave nothing for {num_replicas} replicas")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Samples of one epoch on this rank."""
        if self.drop_last:
            return self.num_samples // self.num_replicas
        return -(-self.num_samples // self.num_replicas)

    def indices(self, epoch: int) -> list[int]:
        """This rank's sample indices of `epoch`, in order."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        total = len(self) * self.num_replicas
        if total > len(order):  # pad by repeating from the start, as DistributedSampler does
            order += (order * (-(-total // len(order))))[: total - len(order)]
        return order[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self._roll_over()
        order = self.indices(self.epoch)
        while self.position < len(order):
            index = order[self.position]
            self.position += 1
            yield index
        self._roll_over()

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position, with the configuration they are only meaningful for."""
        self._roll_over()
        return {"epoch": self.epoch, "position": self.position, **self._config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in self._config().items():
            if state.get(key) != value:
                raise CheckpointError(
                    f"the checkpoint's sampler has {key}={state.get(key)!r}, this one has {key}={value!r}"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def _config(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "drop_last": self.drop_last,
        }

    def _roll_over(self) -> None:
        """A finished epoch is the start of the next one: saving at an epoch boundary resumes there."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample `index` in `epoch`: well mixed (NumPy's SeedSequence), independent of
    worker, rank and position, different from epoch to epoch."""
    high, low = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint32)
    return (int(high) << 32) | int(low)


@contextlib.contextmanager
def seeded_rngs(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG, `random` and NumPy's global RNG from `seed` for the duration of the block,
    then put back the states they had: in a worker nothing leaks into the next sample, and with
    `num_workers=0` the training loop's own RNG streams are left untouched."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that would also reseed CUDA's
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def batch_seed(sample_seeds: Sequence[int]) -> int:
    """The 64-bit seed of a batch: a function of its samples' seeds, so of (seed, epoch, the samples' indices)
    in their order; independent of worker, rank and position, like `sample_seed`."""
    words = [part for seed in sample_seeds for part in (seed >> 32, seed & 0xFFFF_FFFF)]
    high, low = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return (int(high) << 32) | int(low)


class SeededCollate:
    """A DataLoader's `collate_fn`, run under `seeded_rngs(batch_seed(...))` of the batch it collates.

    A collator's own randomness (a masked-LM collator's masks) would otherwise come from the worker's RNG stream
    (or, with no workers, the training loop's), which a resume shifts. `keyed` is the dataset side that loaded
    the batch: the DataLoader's fetcher calls its `__getitems__` and then this, in the same process, and it
    notes the batch's `(index, seed)` keys in `last_keys` (None for a batch loaded by plain indices, which is
    collated as it is)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], keyed: Any) -> None:
        self.collate_fn = collate_fn
        self.keyed = keyed

    def __call__(self, batch: list[Any]) -> Any:
        keys, self.keyed.last_keys = self.keyed.last_keys, None
        if keys is None:
            return self.collate_fn(batch)
        with seeded_rngs(batch_seed([seed for _, seed in keys])):
            return self.collate_fn(batch)


class SeededDataset(Dataset):
    """A dataset indexed by `(index, seed)`: loads `dataset[index]` under `seeded_rngs(seed)`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.last_keys: list[tuple[int, int]] | None = None
        """The keys of the batch loaded last in this process, for `SeededCollate`."""

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        with seeded_rngs(seed):
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """The batched read DataLoader's fetcher uses: the samples, and the keys noted for the collate_fn."""
        self.last_keys = list(keys)
        return [self[key] for key in keys]


class ResumableLoader:
    """Batches of a map-style dataset in `ResumableSampler` order, with per-sample seeded randomness.

    Each `iter()` yields the rest of the sampler's current epoch, from its position, through a
    `torch.utils.data.DataLoader` (so `num_workers`, `collate_fn`, `pin_memory`, ... work as usual; the
    DataLoader gets its own generator, so starting an epoch does not draw from the global torch RNG).
    The sampler's position advances as batches are handed to the loop, not as workers prefetch them, so
    `state_dict()` after a step is exactly the data position of that step.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        sampler: ResumableSampler,
        batch_size: int,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be positive, not {batch_size}")
        if drop_last and batch_size > len(sampler):
            raise UsageError(f"with drop_last, batches of {batch_size} leave nothing of {len(sampler)} samples")
        for name in ("sampler", "batch_sampler", "shuffle", "generator", "worker_init_fn", "persistent_workers"):
            if name in dataloader_kwargs:
                raise UsageError(f"ResumableLoader sets the DataLoader's {name} itself; do not pass it")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.dataloader_kwargs = dataloader_kwargs
        self.pending_skip = 0
        """Batches the next iterations drop before they hand one out (`skip_batches`)."""

    def skip_batches(self, count: int) -> None:
        """Drop the next `count` batches: they are loaded and counted as consumed (the data position moves past
        them, across epochs too) but never handed to the loop. The resume contract's data controls use it."""
        if count < 0:
            raise UsageError(f"cannot skip a negative number of batches ({count})")
        self.pending_skip += count

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        self._roll_over()
        epoch, start = sampler.epoch, sampler.position
        dropped = drop_samples_requested()
        # Each key with the sampler's position just past it: a dropped sample (the contract's DETRACE_DROP_SAMPLES)
        # is never loaded, but the position moves past it as past the samples trained on.
        placed = [(after, (index, sample_seed(sampler.seed, epoch, index)))
                  for after, index in enumerate(sampler.indices(epoch)[start:], start + 1) if index not in dropped]
        chunks = [placed[at : at + self.batch_size] for at in range(0, len(placed), self.batch_size)]
        if self.drop_last and chunks and len(chunks[-1]) < self.batch_size:
            chunks.pop()
        batches = [[key for _, key in chunk] for chunk in chunks]
        dataset = SeededDataset(self.dataset)
        loader = DataLoader(
            dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            # A collator's randomness is seeded per batch, as each sample's is.
            collate_fn=SeededCollate(self.collate_fn or default_collate, dataset),
            # A generator of its own: without one, every iter() would draw its worker base seed from the
            # global torch RNG and so shift the training loop's dropout masks by one draw per epoch.
            generator=torch.Generator().manual_seed(sampler.seed),
            **self.dataloader_kwargs,
        )
        handed: collections.deque[list[int]] = collections.deque(maxlen=PENDING_BATCHES)
        # The tracer's batch rung takes one batch's sample indices per training forward (`detrace ablate` names a
        # spike's sample from them); a loader iterated inside this one (an evaluation's) hands the source back.
        before, _events.sample_source[:] = list(_events.sample_source), [lambda: handed.popleft() if handed else None]
        mine = _events.sample_source[0]
        try:
            for chunk, batch_keys, batch in zip(chunks, batches, loader, strict=True):
                # Consumed as soon as it is handed over: a checkpoint after this step must not replay it.
                sampler.position = chunk[-1][0]
                if self.pending_skip:
                    self.pending_skip -= 1
                    continue
                handed.append([index for index, _ in batch_keys])
                yield batch
            # Past the epoch's last batch (and its dropped or cut-off samples), unless a save after the last batch
            # already rolled the sampler over into the next epoch: moving it again would skip that epoch.
            if sampler.epoch == epoch:
                sampler.position = len(sampler)
        finally:
            if _events.sample_source == [mine]:
                _events.sample_source[:] = before
        self._roll_over()

    def __len__(self) -> int:
        """Batches in a whole epoch."""
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def state_dict(self) -> dict[str, Any]:
        self._roll_over()
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def _roll_over(self) -> None:
        """Past the last batch of an epoch (or past the last full one, with `drop_last`), the next epoch starts."""
        rest = len(self.sampler) - self.sampler.position
        if rest <= 0 or (self.drop_last and rest < self.batch_size):
            self.sampler.epoch += 1
            self.sampler.position = 0
