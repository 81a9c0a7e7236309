"""Streams that resume exactly where they can say where they are: a TrainState loop over an `IterableDataset` read
through torchdata's `StatefulDataLoader` (a dataset of our own with state_dict, HF `datasets`' IterableDataset),
stopped after step 2 and resumed in the same process from fresh objects, with 0 and 2 workers; a state that only
pickle could store refused in one sentence; how the HF callback picks a stream's loader (accelerate's adapter)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _tools import close_loader_workers
from torch.utils.data import DataLoader, IterableDataset

from detrace.errors import CheckpointError
from detrace.integrations._seeding import resumable_stream
from detrace.state import TrainState

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
datasets = pytest.importorskip("datasets")

ROWS = torch.rand(48, 6, generator=torch.Generator().manual_seed(3))
STEPS, STOP = 5, 2  # 48 rows in batches of 4 over 2 workers: the stream does not end within 5 steps


class Counted(IterableDataset):
    """A stream of rows that says where it is (the next row of each worker's share) and keeps a value `extra` in its
    state: a JSON value by default."""

    def __init__(self, extra: Any = None) -> None:
        self.next = 0
        self.extra = extra

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        mine = list(range(worker, len(ROWS), workers))
        while self.next < len(mine):
            row = ROWS[mine[self.next]]
            self.next += 1
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "extra": self.extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def _hf_stream() -> Any:
    rows = datasets.Dataset.from_dict({"x": ROWS.tolist()})
    return rows.to_iterable_dataset(num_shards=2).with_format("torch")


def _hf_batch(batch: Any) -> torch.Tensor:
    return batch["x"] if isinstance(batch, dict) else batch


def _final_parameters(make_dataset: Callable[[], Any], workers: int, *, stop: int | None = None,
                      resume: Path | None = None, save: Path | None = None) -> list[torch.Tensor]:
    """A tiny loop with dropout; `stop` saves after that step and ends, `resume` loads first (fresh objects)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = StatefulDataLoader(make_dataset(), batch_size=4, num_workers=workers)
    state = TrainState(model=model, optimizer=optimizer, data=loader)
    start = state.load(resume) if resume is not None else 0
    batches = iter(loader)
    for step in range(start + 1, STEPS + 1):
        batch = _hf_batch(next(batches))
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step = step
        if step == stop:
            assert save is not None
            state.save(save)
            break
    close_loader_workers(loader)
    return [value.detach().clone() for value in model.state_dict().values()]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make_dataset", [Counted, _hf_stream], ids=["own-stream", "hf-datasets"])
def test_a_stateful_stream_resumes_exactly(tmp_path: Path, workers: int, make_dataset: Callable[[], Any]) -> None:
    torch.set_num_threads(1)
    continuous = _final_parameters(make_dataset, workers)
    _final_parameters(make_dataset, workers, stop=STOP, save=tmp_path / "ckpt")
    resumed = _final_parameters(make_dataset, workers, resume=tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(resumed, continuous, strict=True))


def test_a_stream_restarted_from_its_first_row_is_not_the_same_run(tmp_path: Path) -> None:
    """What the saved position is worth: resumed from the same checkpoint without it (the skip-data control), the
    stream starts over and the run ends with other parameters."""
    torch.set_num_threads(1)
    continuous = _final_parameters(Counted, 0)
    _final_parameters(Counted, 0, stop=STOP, save=tmp_path / "ckpt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = StatefulDataLoader(Counted(), batch_size=4)
    state = TrainState(model=model, optimizer=optimizer, data=loader)
    start = state.load(tmp_path / "ckpt", control="skip-data")
    batches = iter(loader)
    for _ in range(start + 1, STEPS + 1):
        loss = model(next(batches)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final = list(model.state_dict().values())
    assert not all(torch.equal(a, b) for a, b in zip(final, continuous, strict=True))


def test_a_stream_state_that_only_pickle_could_store_is_refused_in_one_sentence(tmp_path: Path) -> None:
    model = torch.nn.Linear(6, 1)
    loader = StatefulDataLoader(Counted(extra=object()), batch_size=4)
    state = TrainState(model=model, data=loader)
    next(iter(loader))
    with pytest.raises(CheckpointError) as refused:
        state.save(tmp_path / "ckpt")
    assert str(refused.value) == ("cannot save 'rank0.data.dataset_state.extra': a value of type object is neither a "
                                  "tensor nor JSON data")
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_the_hf_callback_reads_a_stateful_stream_through_a_stateful_loader() -> None:
    """accelerate's adapter over a plain DataLoader of a stream with state_dict gets a StatefulDataLoader of the same
    settings (what accelerate's use_stateful_dataloader builds); a stream without state, or a map-style dataset, is
    not touched."""
    from accelerate.data_loader import DataLoaderShard

    def collate(rows: list[Any]) -> Any:
        return rows

    shard = DataLoaderShard(_hf_stream(), batch_size=3, num_workers=2, collate_fn=collate, drop_last=True)
    plain = shard.base_dataloader
    assert resumable_stream(shard) is shard
    base = shard.base_dataloader
    assert isinstance(base, StatefulDataLoader) and base is not plain
    assert (base.batch_size, base.num_workers, base.collate_fn, base.drop_last) == (3, 2, collate, True)
    assert shard.state_dict() == base.state_dict()  # accelerate's snapshot of the new loader
    assert resumable_stream(shard) is shard and shard.base_dataloader is base  # once

    class Stateless(IterableDataset):
        def __iter__(self) -> Iterator[int]:
            yield from range(4)

    stateless = DataLoaderShard(Stateless(), batch_size=2)
    assert resumable_stream(stateless) is None and not isinstance(stateless.base_dataloader, StatefulDataLoader)
    assert resumable_stream(DataLoader(_hf_stream(), batch_size=2)) is None  # the user's own loader: left as it is
    assert resumable_stream(DataLoaderShard(list(range(8)), batch_size=2)) is None  # map-style: seeded by index
