"""Per-sample seeded randomness and a pinned order for a DataLoader that a framework built.

A framework resumes the data position (which batch comes next) but not the randomness of the samples: a
DataLoader worker draws a sample's augmentation from the worker's own RNG stream, and after a mid-epoch
restart each sample lands on another worker at another point of that stream; with no workers, the samples
draw from the training loop's own RNG, interleaved with dropout. Both are fixed here the way
`detrace.state.ResumableLoader` fixes them, on a DataLoader that already exists (the framework holds it):

- the index sampler is wrapped so it yields `(index, seed)` keys, the seed being `sample_seed(seed, epoch,
  index)`; a `RandomSampler` that would draw its order from the global RNG gets a generator seeded from
  `seed + epoch` instead, so an epoch's order does not depend on where the run was resumed;
- the dataset gets a `__getitems__` (the batched read DataLoader's fetcher uses when present) that loads each
  keyed sample under `seeded_rngs(seed)`: the same augmentation on any worker, in any process, with any
  `num_workers`, and the training loop's RNG streams untouched.

An `IterableDataset` has no sample index. A stream that can say where it is (a dataset with `state_dict`, or one
read through torchdata's `StatefulDataLoader`) is read through a StatefulDataLoader (`resumable_stream`), whose
state the integration saves with the rest and restores on resume. Any other stream is left alone, with one
warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

from detrace import record as tracing
from detrace.errors import UsageError
from detrace.state.contract import (
    ENV_DROP_SAMPLES,
    ENV_SKIP_STEPS,
    batches_to_skip,
    drop_samples_requested,
    skip_steps_requested,
)
from detrace.state.loader import SeededCollate, seeded_rngs
from detrace.state.sample_keys import SampleKeys
from detrace.state.train_state import is_stateful


class SeededItems:
    """The dataset's `__getitems__`: each `(index, seed)` key is loaded under `seeded_rngs(seed)`; a plain
    index (another DataLoader over the same dataset, such as an evaluation loader) is loaded as it is."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.last_keys: list[tuple[int, int]] | None = None
        """The keys of the batch loaded last in this process, for `SeededCollate` (None for plain indices)."""

    def __call__(self, keys: list[Any]) -> list[Any]:
        self.last_keys = list(keys) if keys and all(isinstance(key, tuple) for key in keys) else None
        items = []
        for key in keys:
            if isinstance(key, tuple):
                index, seed = key
                with seeded_rngs(seed):
                    items.append(self.dataset[index])
            else:
                items.append(self.dataset[key])
        return items


@functools.cache
def _warn_unindexed(framework: str, hint: str) -> None:
    """Once per process and framework: the data is left as it is."""
    text = (f"detrace's {framework} integration leaves this IterableDataset's data alone: a stream has no sample "
            f"index to seed its randomness from, and the data position it resumes at is the framework's own{hint}")
    warnings.warn(text, RuntimeWarning, stacklevel=3)
    tracing.warned(text)


def resumable_stream(loader: Any) -> Any | None:
    """The loader of an `IterableDataset` that can say where its stream is, or None.

    That is `loader` when it reads the stream through torchdata's `StatefulDataLoader` (directly, or inside
    accelerate's DataLoader adapter, whose own `state_dict` accounts for the batch it reads ahead). When the dataset
    itself has `state_dict` / `load_state_dict` (HF `datasets`' IterableDataset) but accelerate's adapter holds a
    plain DataLoader, the adapter gets a StatefulDataLoader of the same settings instead, as accelerate's
    `use_stateful_dataloader` would have built it: the dataset's own state then travels with the loader's, taken
    when a batch is handed over rather than read ahead, and from every worker."""
    if not isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is optional: without it no loader can be one
        return None
    base = loader
    while getattr(base, "base_dataloader", None) is not None:
        base = base.base_dataloader
    if isinstance(base, StatefulDataLoader):
        return loader
    if base is loader or not is_stateful(base.dataset):  # the user's own loader, or a stream that cannot say where
        return None
    return make_stateful(loader)


def make_stateful(loader: Any) -> Any:
    """Give accelerate's DataLoader adapter `loader` (in place) torchdata's `StatefulDataLoader` of the settings of the
    plain DataLoader it wraps, as accelerate's `use_stateful_dataloader` would have built it, so that it can say
    where it is (`state_dict`, taken when a batch is handed over rather than read ahead) and resume there. A map-style
    dataset keeps its batch sampler (accelerate's shard of the epoch); the StatefulDataLoader's state is then the
    batches yielded in the epoch, and it resumes by stepping its sampler past them. Returns `loader`."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    base = loader.base_dataloader
    if isinstance(base, StatefulDataLoader):
        return loader
    dataset, workers = base.dataset, base.num_workers
    batching: dict[str, Any] = (
        {"batch_size": base.batch_size, "drop_last": base.drop_last} if isinstance(dataset, IterableDataset)
        else {"batch_sampler": base.batch_sampler} if base.batch_sampler is not None
        else {"sampler": base.sampler, "batch_size": None})
    loader.base_dataloader = StatefulDataLoader(
        dataset, **batching, collate_fn=base.collate_fn,
        num_workers=workers, pin_memory=base.pin_memory, timeout=base.timeout, worker_init_fn=base.worker_init_fn,
        multiprocessing_context=base.multiprocessing_context if workers else None, generator=base.generator,
        prefetch_factor=base.prefetch_factor if workers else None, persistent_workers=base.persistent_workers,
    )
    loader.use_stateful_dataloader = True
    loader.dl_state_dict = loader.base_dataloader.state_dict()  # accelerate's snapshot, as its constructor takes it
    return loader


def seed_samples(loader: DataLoader, *, seed: int, framework: str, hint: str = "", record: bool = False
                 ) -> SampleKeys | None:
    """Give the samples of `loader` per-sample seeded randomness and its shuffling a pinned order (in place).

    Returns the key sampler, whose `epoch` the caller sets as each epoch starts. Calling it again on the same
    loader returns the sampler installed the first time. An `IterableDataset` has no sample index: it is left
    alone (with one warning, ending in `hint`) and None is returned; training goes on as without detrace's data
    handling. `record`: keep each batch's sample indices for the tracer (`SampleKeys.batching`); only where the
    caller knows every batch the loop draws without training on it (`SampleKeys.unseen`): a loader that resumes by
    stepping its sampler past the trained batches (a StatefulDataLoader) would shift every record of the resumed
    run.
    """
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        _warn_unindexed(framework, hint)
        return None
    holders = []  # every level of (batch) sampler wrappers that holds the index sampler
    level: Any = loader.batch_sampler
    while level is not None:
        if isinstance(getattr(level, "sampler", None), Sampler):
            holders.append(level)
        level = getattr(level, "batch_sampler", None)
    if not holders:
        raise UsageError(f"the {framework} DataLoader's batch sampler {type(loader.batch_sampler).__name__} "
                         "exposes no index sampler for detrace to seed")
    index_sampler = holders[-1].sampler
    if isinstance(index_sampler, SampleKeys):
        return index_sampler
    keys = SampleKeys(index_sampler, seed=seed)
    size = getattr(holders[-1], "batch_size", None)
    # Only where the loader's own batch sampler makes the batches: a wrapper above it (accelerate's shard of each
    # batch under DDP) hands this rank other batches than the ones the index sampler's order groups.
    if record and holders[-1] is loader.batch_sampler and isinstance(size, int) and size > 0:
        keys.batching = size, bool(getattr(holders[-1], "drop_last", False))
    for holder in holders:
        if holder.sampler is index_sampler:
            holder.sampler = keys
    dataset = loader.dataset
    items = vars(dataset).get("__getitems__")
    if not isinstance(items, SeededItems):
        # DataLoader's fetcher looks `__getitems__` up on the dataset object, so an instance attribute is used.
        items = dataset.__getitems__ = SeededItems(dataset)  # type: ignore[attr-defined]
    # accelerate's prepared DataLoader is an adapter that iterates the DataLoader it wraps, with that one's collate_fn.
    iterated: Any = loader
    while getattr(iterated, "base_dataloader", None) is not None:
        iterated = iterated.base_dataloader
    if not isinstance(iterated.collate_fn, SeededCollate):
        # A collator's randomness (a masked-LM collator's masks) is seeded per batch, as each sample's is.
        iterated.collate_fn = SeededCollate(iterated.collate_fn, items)
    return keys


def skip_for_controls(keys: SampleKeys | None, step: int, samples_per_step: int, *, framework: str) -> None:
    """The resume contract's data controls (DETRACE_DATA_SHIFT, DETRACE_SKIP_STEPS) as a framework run starts at
    global step `step`: the key sampler leaves out the samples of the batches they name.

    A framework's loop prefetches batches, so the integrations apply the controls only where the run starts (0 or
    the resumed step): a DETRACE_SKIP_STEPS window must begin at or before it (resume from the checkpoint at its
    first step). `keys` is None for an IterableDataset (left alone), to which no control applies."""
    window = skip_steps_requested()
    if window is not None and window[0] > step:
        raise UsageError(f"{ENV_SKIP_STEPS}={window[0]}-{window[1]}: detrace's {framework} integration skips "
                         f"batches only from the step the run starts at ({step}); resume from a checkpoint at or "
                         "before the window's first step, or use DETRACE_DATA_SHIFT")
    if drop_samples_requested() and keys is None:
        raise UsageError(f"the resume contract's {ENV_DROP_SAMPLES} names samples by index: detrace's {framework} "
                         "integration cannot drop them from an IterableDataset")
    skip = batches_to_skip(step, first=True)
    if skip and keys is None:
        raise UsageError(f"the resume contract's data controls ({ENV_SKIP_STEPS}, DETRACE_DATA_SHIFT) skip samples "
                         f"by index: detrace's {framework} integration cannot apply them to an IterableDataset")
    if keys is not None:
        keys.skip += skip * samples_per_step
