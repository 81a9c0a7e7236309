"""DetraceCallback's logic in process: which Lightning strategies it supports, how it steps aside from the others,
and its per-sample data seeding on the DistributedSampler that Lightning installs under DDP (each rank's shard).
The real runs (one process, and DDP under torchrun) are in tests/e2e/test_integrations_lightning.py."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from detrace.integrations._seeding import seed_samples
from detrace.integrations.lightning import DetraceCallback, _unsupported
from detrace.state.loader import sample_seed, seeded_rngs


def test_one_process_and_ddp_started_by_running_the_script_are_supported() -> None:
    assert _unsupported(SingleDeviceStrategy(device=torch.device("cpu"))) is None
    assert _unsupported(DDPStrategy()) is None  # strategy="ddp": torchrun, or Lightning's own launch


@pytest.mark.parametrize(
    ("strategy", "clause"),
    [
        (DDPStrategy(start_method="spawn"), "but this DDPStrategy starts them with multiprocessing (spawn); use "
                                            "strategy='ddp'"),
        (FSDPStrategy(), "it supports one process and strategy='ddp', not FSDPStrategy"),
        # a DDPStrategy subclass, made without deepspeed installed: only its type matters here
        (DeepSpeedStrategy.__new__(DeepSpeedStrategy), "it supports one process and strategy='ddp', not "
                                                       "DeepSpeedStrategy"),
    ],
)
def test_other_strategies_are_named(strategy: object, clause: str) -> None:
    assert clause in (_unsupported(strategy) or "")


def _trainer(*, rank: int) -> SimpleNamespace:
    """What the callback's `setup` reads of a Trainer with an unsupported strategy."""
    return SimpleNamespace(strategy=FSDPStrategy(), is_global_zero=rank == 0)


@pytest.mark.parametrize("contract", [{"DETRACE_STOP_AT": "2"}, {"DETRACE_RESUME": "1"}, {"DETRACE_CKPT_EVERY": "2"}])
def test_an_unsupported_strategy_under_the_contract_is_refused_in_one_sentence(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object, contract: dict[str, str]) -> None:
    for name, value in {"DETRACE_CKPT_DIR": str(tmp_path), **contract}.items():
        monkeypatch.setenv(name, value)
    callback = DetraceCallback()
    # SystemExit: Lightning passes it on, and Python prints its message alone, with no traceback, on every rank
    with pytest.raises(SystemExit) as refused:
        callback.setup(_trainer(rank=1), None, "fit")
    assert str(refused.value) == ("detrace: the Lightning integration cannot stop, save or resume this run: it "
                                  "supports one process and strategy='ddp', not FSDPStrategy")


def test_an_unsupported_strategy_without_the_contract_trains_on_after_one_warning() -> None:
    for rank, warned in ((0, 1), (1, 0)):  # the warning comes from rank 0 only: one per run
        callback = DetraceCallback()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback.setup(_trainer(rank=rank), None, "fit")
        assert [str(w.message) for w in caught] == [
            "detrace's Lightning integration leaves this run alone (no resume, no data seeding): it supports one "
            "process and strategy='ddp', not FSDPStrategy"][:warned]
        assert callback._inactive
        callback.on_train_start(_trainer(rank=rank), None)


class Noisy(Dataset):
    """Index plus noise from torch's global RNG: the augmentation a resume must reproduce."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return index + torch.rand(())


def _lightning_ddp_loader(rank: int) -> DataLoader:
    """The training DataLoader as Lightning's DDP rebuilds a `shuffle=True` one on `rank` of 2: a DistributedSampler
    (shuffled, seeded from PL_GLOBAL_SEED) in place of the RandomSampler."""
    sampler: DistributedSampler[int] = DistributedSampler(Noisy(), num_replicas=2, rank=rank, shuffle=True, seed=0)
    return DataLoader(Noisy(), batch_size=2, sampler=sampler)


def _samples(loader: DataLoader) -> list[tuple[int, float]]:
    return [(int(item), float(item)) for batch in loader for item in batch]


def test_each_rank_loads_its_own_shard_with_per_sample_seeds_and_resumes_inside_it() -> None:
    shards = []
    for rank in (0, 1):
        loader = _lightning_ddp_loader(rank)
        keys = seed_samples(loader, seed=7, framework="Lightning Trainer")
        assert keys is not None
        _set_sampler_epoch(loader, 1)  # as Lightning does at each epoch start: it reaches the DistributedSampler
        keys.epoch = 1
        reference: DistributedSampler[int] = DistributedSampler(Noisy(), num_replicas=2, rank=rank, shuffle=True,
                                                                seed=0)
        reference.set_epoch(1)
        shard = list(reference)  # the rank's own indices in epoch 1's order
        shards.append(set(shard))
        expected = []
        for index in shard:
            with seeded_rngs(sample_seed(7, 1, index)):
                expected.append((index, float(index + torch.rand(()))))
        assert _samples(loader) == expected
        # a resume inside the epoch: the rank skips the samples of its shard that it trained, and loads the rest
        # with the same noise
        keys.skip = 2
        assert _samples(loader) == expected[2:]
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(10))
