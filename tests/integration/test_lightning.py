"""DetraceCallback in process: exact resume of the example's Trainer in one process (an MLP with dropout, a random
augmentation in the dataset, gradient accumulation, an LR scheduler) from a periodic checkpoint, with 2 DataLoader
workers or none; a flipped bit refused by tensor name; the contract's errors; which strategies it supports and how
it steps aside from the others; its per-sample data seeding on the DistributedSampler that Lightning installs under
DDP (each rank's shard). The real runs under torchrun are in tests/e2e/test_integrations_lightning.py."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from unittest import mock

import pytest
import torch
from _tools import flip_one_bit, load_script
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from detrace.errors import CheckpointCorrupted, DetraceError
from detrace.integrations._seeding import seed_samples
from detrace.integrations.lightning import DetraceCallback, _unsupported
from detrace.state.contract import saved_versions
from detrace.state.loader import sample_seed, seeded_rngs
from detrace.state.storage import load_chunk, stored_chunks

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_train.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """examples/lightning_train.py, whose `fit` trains its Trainer in this process."""
    return load_script(SCRIPT)


def _fit(example: ModuleType, env: dict[str, str], **options: object) -> str:
    """The example's 6 steps (3 per epoch) under the contract variables `env`: its final parameters' digest."""
    with mock.patch.dict(os.environ, env):
        _, model = example.fit(**options)
    return str(example.digest(model))


@pytest.fixture
def saved(example: ModuleType, tmp_path: Path) -> tuple[str, dict[int, Path]]:
    """A run with 2 DataLoader workers that keeps a checkpoint after every 2nd step: its final parameters, its
    checkpoints. Per test: the callback's detrace.deterministic() changes process-wide state, which conftest puts
    back after each test."""
    root = tmp_path / "ckpt"
    final = _fit(example, {"DETRACE_CKPT_DIR": str(root), "DETRACE_CKPT_EVERY": "2"}, workers=2)
    return final, saved_versions(root)


def test_resume_from_any_periodic_checkpoint_is_exact_with_or_without_workers(
        example: ModuleType, saved: tuple[str, dict[int, Path]]) -> None:
    # What `detrace locate` asks of a script: DETRACE_CKPT_EVERY keeps Lightning's step-N.ckpt of every 2nd step, and
    # DETRACE_RESUME_FROM resumes from any of them. Each sample's augmentation has its own seed: a run without
    # workers ends with the bits of the run with 2, and so does a run resumed mid-epoch (after step 2 of 3) with
    # no workers from the checkpoint of the run with 2, handing it to `fit(ckpt_path=...)` itself.
    final, versions = saved
    assert sorted(versions) == [2, 4, 6] and versions[2].name == "step-00000002.ckpt"
    assert _fit(example, {}, workers=0) == final
    assert _fit(example, {"DETRACE_RESUME_FROM": str(versions[2])}, workers=0, pass_ckpt=True) == final
    # the negative control: the same resume without the RNG states (dropout) ends elsewhere
    assert _fit(example, {"DETRACE_RESUME_FROM": str(versions[2]), "DETRACE_RESUME_CONTROL": "skip-rng"}) != final


def test_an_ablate_variants_data_shift_goes_through_the_callback(example: ModuleType,
                                                                 saved: tuple[str, dict[int, Path]]) -> None:
    # What `detrace ablate` runs for a variant: resumed from the periodic checkpoint after step 2 (an epoch's end)
    # with DETRACE_DATA_SHIFT=1, the callback skips one step's samples, and the run ends elsewhere than its
    # baseline, which, resumed from the same checkpoint without the shift, ends with the original run's bits.
    final, versions = saved
    assert _fit(example, {"DETRACE_RESUME_FROM": str(versions[2])}) == final
    assert _fit(example, {"DETRACE_RESUME_FROM": str(versions[2]), "DETRACE_DATA_SHIFT": "1"}) != final


def test_lightning_alone_resumed_from_its_own_checkpoint_changes_the_run(example: ModuleType, tmp_path: Path) -> None:
    # The example without the callback (--plain): stopped after step 2 of an epoch of 3 and resumed by Lightning's
    # own ckpt_path, the run replays the epoch's data order from its start, and ends with other parameters than the
    # run that never stopped. (The callback's arm under DDP: tests/e2e/test_integrations_lightning.py.)
    root = str(tmp_path / "plain")
    continuous = _fit(example, {}, plain=True)
    _fit(example, {"DETRACE_CKPT_DIR": root, "DETRACE_STOP_AT": "2"}, plain=True)
    assert sorted(p.name for p in Path(root).iterdir()) == ["step-2.ckpt"]
    assert _fit(example, {"DETRACE_CKPT_DIR": root, "DETRACE_RESUME": "1"}, plain=True) != continuous


def test_a_flipped_bit_is_refused_naming_the_tensor(example: ModuleType, saved: tuple[str, dict[int, Path]],
                                                    tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000002.ckpt"
    shutil.copy(saved[1][2], ckpt)
    shutil.copytree(f"{saved[1][2]}.detrace", f"{ckpt}.detrace")
    version = next(Path(f"{ckpt}.detrace").glob("step-*"))
    chunk = next(chunk for chunk in stored_chunks(version) if chunk.fqn == "model.net.0.weight")
    flip_one_bit(version, load_chunk(version, chunk))
    with pytest.raises(CheckpointCorrupted) as refused:
        _fit(example, {"DETRACE_RESUME_FROM": str(ckpt)})
    assert "tensor 'model.net.0.weight' does not match its fingerprint in the manifest" in str(refused.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DETRACE_RESUME": "1"}, "holds no Lightning checkpoint"),
        ({"DETRACE_RESUME": "yes"}, "DETRACE_RESUME must be 1 or 0"),
        ({"DETRACE_STOP_AT": "ten"}, "DETRACE_STOP_AT must be a step number"),
        ({"DETRACE_RESUME": "1", "DETRACE_RESUME_CONTROL": "skip-everything"}, "not a known negative control"),
        ({"DETRACE_CKPT_EVERY": "0"}, "DETRACE_CKPT_EVERY must be a step number of at least 1"),
        ({"DETRACE_RESUME_FROM": "/nowhere/step-00000002.ckpt"}, "but there is no such checkpoint"),
    ],
)
def test_contract_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for name, value in {"DETRACE_CKPT_DIR": str(tmp_path), **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DetraceError, match=message):
        DetraceCallback().ckpt_path  # noqa: B018 (the property reads the contract)


def test_restore_part_in_a_run_that_does_not_resume_is_refused(example: ModuleType, tmp_path: Path) -> None:
    """The callback ignored DETRACE_RESTORE_PART without a word when fit did not resume: the run trained on with none
    of the part it asked for. It is refused as TrainState's loop refuses it."""
    with pytest.raises(DetraceError, match=r"^DETRACE_RESTORE_PART=lr:.* takes a part of the state from a checkpoint "
                                           r"when the run resumes, and this run does not \(DETRACE_RESUME is not 1 "
                                           r"and DETRACE_RESUME_FROM is not set\)$"):
        _fit(example, {"DETRACE_RESTORE_PART": f"lr:{tmp_path}"}, steps=1)


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
