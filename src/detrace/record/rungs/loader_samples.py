"""At every rung: the dataset indices of each batch a plain DataLoader hands the training loop, for the batch rung.

The batch rung records, after each training forward's batch, the dataset indices of its samples when a sampler
knows them (`_events.sample_source`): detrace's own (the framework integrations' `SampleKeys`, `ResumableLoader`)
register themselves. Any other map-style DataLoader (a plain loop's, HF `Trainer`'s without detrace's callback)
is seen here: its iterator asks its batch sampler for each batch's indices, in the main process, in the order the
batches reach the loop (also with workers that prefetch), and they are queued per iterator; the iterator that
dispatched last is the source; an evaluation loader iterated between two training batches hands it back when it is
exhausted. A batch dispatched with grad disabled (a loop's `with torch.no_grad(): for x, y in val_loader`) that an
evaluation's forward takes (`evaluation_takes`) is dropped: with no training loader to hand the source back to (a
loop that makes its own training batches), it would otherwise go to the next training forward; so is one that
another loader than the training's dispatched, grad enabled or not. A forward with grad disabled on such a batch is
an evaluation even in train mode (`from_another_loader`: a validation loop that forgot `model.eval()`).
`check-resume` tells the same samples augmented otherwise from another data position with them, and `detrace
ablate` names a spike's sample.

Left alone: a loader whose indices are not plain integers (detrace's keyed samplers: their own source says them),
an `IterableDataset` (no index), a loader built with `in_order=False` (batches reach the loop out of order), and any
loader while one of detrace's own samplers is the source.
"""

from __future__ import annotations

import collections
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from detrace import _compat, _events
from detrace.record.records import recorded_leaves, shares_data
from detrace.record.session import Tracer
from detrace.state.loader import PENDING_BATCHES

Undo = Callable[[], None]


class _Batch:
    """One batch a DataLoader's iterator dispatched."""

    def __init__(self, indices: list[int], *, evaluation: bool) -> None:
        self.indices = indices
        self.evaluation = evaluation
        """Whether it was dispatched with grad disabled (an evaluation's, likely)."""
        self.tensors: list[weakref.ref[torch.Tensor]] | None = None
        """The tensors of the batch once the iterator handed it to the loop (weak: the loop may drop it)."""

    def taken_by(self, tensors: list[Any]) -> bool:
        """Whether a forward on `tensors` takes this batch (one of its tensors, or a view of one)."""
        mine = [tensor for ref in self.tensors or () if (tensor := ref()) is not None]
        return shares_data(tensors, mine)


class _Handed:
    """One DataLoader iterator's batches of sample indices, dispatched and not yet taken by a training forward."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        """The batch sampler its indices come from: the same for each epoch's iterator of one DataLoader."""
        self.batches: collections.deque[_Batch] = collections.deque(maxlen=PENDING_BATCHES)
        """Each batch, in the order the iterator dispatched them (and hands them to the loop)."""
        self.before: _Handed | None = None
        """The source this one took over from (a training loader's, for an evaluation's): the source again once
        this iterator is exhausted."""
        self.exhausted = False
        """Its batch sampler has no more batches (some may still be on their way to the loop)."""

    def __call__(self) -> list[int] | None:
        return self.batches.popleft().indices if self.batches else None

    def handed(self, value: Any) -> None:
        """The iterator handed the loop its next batch, `value`: the first one not handed yet."""
        for batch in self.batches:
            if batch.tensors is None:
                batch.tensors = [weakref.ref(leaf) for leaf in recorded_leaves(value)
                                 if isinstance(leaf, torch.Tensor)]
                return


def _next_batch() -> _Handed | None:
    """The indices of the loader that dispatched last, when it has a batch no forward took yet."""
    source = _events.sample_source[0] if _events.sample_source else None
    return source if isinstance(source, _Handed) and source.batches else None


def from_another_loader() -> bool:
    """Whether the batch the next forward takes was dispatched by another DataLoader than the one the last training
    forward took from (a validation loader's), as far as the loaders' indices tell: a loop without a training
    DataLoader has none, a process that trained no step yet cannot tell."""
    source = _next_batch()
    if source is None or not _events.trained_from:
        return False
    trained = _events.trained_from[0]
    return trained is not source and not (isinstance(trained, _Handed) and trained.sampler is not None
                                          and trained.sampler is source.sampler)  # (the next epoch's iterator)


def evaluation_takes() -> None:
    """An evaluation's forward takes the next batch of the loader that dispatched last when that batch was
    dispatched with grad disabled, or by another loader than the one the last training forward took from: its
    indices are dropped, never a training forward's. (A batch of the training's own loader dispatched with grad
    enabled is one that an evaluation on tensors of its own ran before: it stays for the training. An evaluation loop
    that iterates its loader with grad enabled and runs only its forward under no_grad, as HF `Trainer`'s does, left
    its last batch to the next training forward, which then named the evaluation's samples.)"""
    source = _next_batch()
    if source is not None and (source.batches[0].evaluation or from_another_loader()):
        source.batches.popleft()


def training_takes(tensors: list[Any]) -> None:
    """A training forward on `tensors` is about to take the next batch: when the loop drew batches and dropped them
    (`itertools.islice(loader, done, None)` past the batches trained before a resume, a `continue` in an
    `enumerate`), the batch it trains on is the one whose tensors it takes, and the ones handed to the loop before
    it are dropped. (A forward on tensors of no batch handed out, moved to a GPU: the next batch, as before.)"""
    source = _next_batch()
    if source is None:
        return
    for skipped, batch in enumerate(source.batches):
        if batch.tensors is None:
            return
        if batch.taken_by(tensors):
            for _ in range(skipped):
                source.batches.popleft()
            return


def _indices(value: Any) -> list[int] | None:
    """A batch's dataset indices (one index: a loader without batching), or None when they are not plain ints."""
    batch = value if isinstance(value, list | tuple) else [value]
    if not batch or not all(isinstance(index, int) and not isinstance(index, bool) for index in batch):
        return None
    return list(batch)


def install(tracer: Tracer) -> list[Undo]:
    handed: weakref.WeakKeyDictionary[Any, _Handed] = weakref.WeakKeyDictionary()

    def note(iterator: Any, value: Any) -> None:
        current = _events.sample_source[0] if _events.sample_source else None
        if current is not None and not isinstance(current, _Handed):
            return  # one of detrace's samplers knows the indices
        batch = _indices(value)
        if batch is None or getattr(iterator, "_in_order", True) is False:
            return
        queue = handed.get(iterator)
        if queue is None:
            queue = handed[iterator] = _Handed(_compat.dataloader_iterator_sampler(iterator))
        queue.batches.append(_Batch(batch, evaluation=not torch.is_grad_enabled()))
        if current is not queue:
            # (a finished epoch's iterator, all of whose batches were taken, is no source to hand back to)
            queue.before = current if current is not None and (current.batches or not current.exhausted) else None
            _events.sample_source[:] = [queue]

    def exhausted(iterator: Any) -> None:
        queue = handed.get(iterator)
        if queue is None or queue.exhausted:
            return
        queue.exhausted = True
        if queue.before is not None and _events.sample_source == [queue]:
            _events.sample_source[:] = [queue.before]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def next_index(iterator: Any) -> Any:
            try:
                value = original(iterator)
            except StopIteration:
                exhausted(iterator)  # (an evaluation's loader, iterated inside the training's, hands the source back)
                raise
            try:
                note(iterator, value)
            except Exception as err:  # the program's batch is loaded all the same; only its record is lost
                print(f"detrace: a batch's sample indices were not noted ({type(err).__name__}: {err})",
                      file=sys.stderr)
            return value

        return next_index

    def wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
        def next_batch(iterator: Any) -> Any:
            value = original(iterator)
            queue = handed.get(iterator)
            if queue is not None:
                try:
                    queue.handed(value)
                except Exception as err:  # the program's batch is handed all the same; only its record is lost
                    print(f"detrace: a batch's tensors were not noted ({type(err).__name__}: {err})",
                          file=sys.stderr)
            return value

        return next_batch

    return [_compat.wrap_dataloader_next_index(wrap), _compat.wrap_dataloader_next(wrap_next)]
