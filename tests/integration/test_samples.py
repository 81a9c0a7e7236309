"""The dataset indices of each step's batch, as the framework integrations' sampler (`SampleKeys`) hands them out
and the batch rung records them, and the resume contract's DETRACE_DROP_SAMPLES, in process: a DataLoader with 2
workers that prefetch, gradient accumulation, a resumed epoch whose trained batches the framework draws and drops
(HF's skip), and an abandoned iterator."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import detrace
from detrace.errors import UsageError
from detrace.integrations._seeding import seed_samples
from detrace.investigate.ablate import batch_samples

BATCH, ACCUMULATE = 3, 2


class Indexed(Dataset):
    """Sample i is the number i: the batch says which samples it holds."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


def flat(steps: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(steps))


def train(out: Path, *, steps: int, env: dict[str, str] | None = None, discard: int = 0, workers: int = 2
          ) -> list[list[int]]:
    """A loop over a shuffled DataLoader seeded by `seed_samples`, traced at the semantic rung, 2 micro-batches a
    step; `discard`: batches the loop draws and drops first, unseen by the sampler's record (HF's resume). Returns
    the indices of the samples each step trained on, read from the batches themselves."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=workers)
    keys = seed_samples(loader, seed=0, framework="test", record=True)
    assert keys is not None
    keys.unseen = discard
    trained: list[list[int]] = []
    with mock.patch.dict(os.environ, env or {}), detrace.trace(out, rung="semantic"):
        batches = iter(loader)
        for _ in range(discard):
            next(batches)
        for _ in range(steps):
            trained.append([])
            for _ in range(ACCUMULATE):
                batch = next(batches)
                trained[-1] += [int(x) for x in batch.flatten()]
                model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return trained


def test_each_step_records_the_samples_it_trained_on_with_workers_that_prefetch(tmp_path: Path) -> None:
    trained = train(tmp_path / "a", steps=3)
    assert [list(batch_samples(tmp_path / "a", 0, step)) for step in range(3)] == trained
    assert len(set(flat(trained))) == 3 * BATCH * ACCUMULATE  # one epoch's order, no sample twice


def test_batches_the_loop_draws_and_drops_are_not_recorded(tmp_path: Path) -> None:
    # HF resumed mid-epoch draws the batches already trained and drops them: without `unseen` every step would
    # be recorded with the samples of a batch 2 earlier.
    trained = train(tmp_path / "a", steps=2, discard=2, workers=0)
    assert [list(batch_samples(tmp_path / "a", 0, step)) for step in range(2)] == trained


def test_dropped_samples_are_never_trained_on_and_the_next_fill_in(tmp_path: Path) -> None:
    reference = train(tmp_path / "a", steps=3)
    dropped = reference[1][:2]
    trained = train(tmp_path / "b", steps=2, env={"DETRACE_DROP_SAMPLES": ",".join(map(str, dropped))})
    assert trained[0] == reference[0]
    order = [i for i in flat(reference) if i not in dropped]
    assert flat(trained) == order[: len(flat(trained))] and not set(dropped) & set(flat(trained))
    assert list(batch_samples(tmp_path / "b", 0, 1)) == trained[1]


def test_an_abandoned_iterator_leaves_nothing_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=2)
    keys = seed_samples(loader, seed=0, framework="test", record=True)
    assert keys is not None
    with detrace.trace(tmp_path / "a", rung="semantic"):
        next(iter(loader))  # prefetched batches, never trained on (Lightning restarts an epoch's iterator)
        keys.epoch = 1  # another order: a stale batch would not pass for this one
        batch = next(iter(loader))
        model(batch).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert list(batch_samples(tmp_path / "a", 0, 0)) == [int(x) for x in batch.flatten()]


def test_a_malformed_drop_is_refused() -> None:
    from detrace.state.contract import drop_samples_requested

    with mock.patch.dict(os.environ, {"DETRACE_DROP_SAMPLES": "3,x"}), pytest.raises(
            UsageError, match=r"^DETRACE_DROP_SAMPLES must be dataset indices separated by commas"):
        drop_samples_requested()


def test_batches_a_wrapper_reshapes_are_not_recorded(tmp_path: Path) -> None:
    # accelerate under DDP wraps the batch sampler in its shard of each batch: this rank trains on other batches
    # than the ones the index sampler's order groups, so no samples are recorded rather than wrong ones.
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, RandomSampler

    dataset = Indexed()
    sharded = BatchSamplerShard(BatchSampler(RandomSampler(dataset), BATCH, False), num_processes=2, process_index=1)
    loader = DataLoader(dataset, batch_sampler=sharded)
    keys = seed_samples(loader, seed=0, framework="test", record=True)
    assert keys is not None and keys.batching is None
    plain = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    keys = seed_samples(plain, seed=0, framework="test", record=True)
    assert keys is not None and keys.batching == (BATCH, False)


def plain(out: Path, *, steps: int, env: dict[str, str] | None = None, evaluate: bool = False) -> list[list[int]]:
    """A plain loop over detrace's ResumableLoader (shuffled, 2 workers that prefetch), traced at the semantic rung,
    one batch a step; `evaluate`: an evaluation loader of its own runs a whole epoch after step 0. Returns the
    indices of the samples each step trained on, read from the batches themselves."""
    from detrace.state import ResumableLoader, ResumableSampler

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ResumableLoader(Indexed(), sampler=ResumableSampler(20, seed=3), batch_size=BATCH, num_workers=2)
    evaluation = ResumableLoader(Indexed(), sampler=ResumableSampler(20, shuffle=False), batch_size=4)
    trained: list[list[int]] = []
    with mock.patch.dict(os.environ, env or {}), detrace.trace(out, rung="semantic"):
        for batch in itertools.islice(loader, steps):
            trained.append([int(x) for x in batch.flatten()])
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if evaluate and len(trained) == 1:
                with torch.no_grad():
                    model.eval()
                    for held_out in evaluation:
                        model(held_out)
                    model.train()
    return trained


@pytest.mark.parametrize("evaluate", [False, True])
def test_a_plain_loop_over_a_resumable_loader_records_its_samples(tmp_path: Path, evaluate: bool) -> None:
    trained = plain(tmp_path / "a", steps=4, evaluate=evaluate)
    assert [list(batch_samples(tmp_path / "a", 0, step)) for step in range(4)] == trained
    assert len(set(flat(trained))) == 4 * BATCH


def test_a_resumable_loader_drops_the_samples_it_is_told_to(tmp_path: Path) -> None:
    reference = plain(tmp_path / "a", steps=5)  # (one step more: the two dropped samples' places are filled)
    dropped = reference[1][:2]
    trained = plain(tmp_path / "b", steps=4, env={"DETRACE_DROP_SAMPLES": ",".join(map(str, dropped))})
    assert trained[0] == reference[0]
    order = [i for i in flat(reference) if i not in dropped]
    assert flat(trained) == order[: len(flat(trained))] and not set(dropped) & set(flat(trained))
    assert list(batch_samples(tmp_path / "b", 0, 1)) == trained[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_dataloader_records_its_samples(tmp_path: Path, workers: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=workers)
    evaluation = DataLoader(Indexed(), batch_size=4)
    trained: list[list[int]] = []
    with detrace.trace(tmp_path / "a", rung="semantic"):
        # 2 epochs of 7 batches; with 2 workers, every index of the first is dispatched before the evaluation
        for batch in itertools.chain(loader, loader):
            trained.append([int(x) for x in batch.flatten()])
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if len(trained) == 5:  # an evaluation between two training batches
                model.eval()
                with torch.no_grad():
                    for held_out in evaluation:
                        model(held_out)
                model.train()
    assert [list(batch_samples(tmp_path / "a", 0, step)) for step in range(14)] == trained
    with detrace.trace(tmp_path / "b", rung="semantic"):  # an IterableDataset has no index: nothing recorded
        stream = DataLoader(Stream(), batch_size=2)
        model(next(iter(stream))).sum().backward()
        optimizer.step()
    assert batch_samples(tmp_path / "b", 0, 0) == ()


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.tensor([1.0]), torch.tensor([2.0])])


def test_an_evaluation_loader_in_a_loop_without_one_gives_no_training_batch_its_samples(tmp_path: Path) -> None:
    """A loop that makes its own training batches and evaluates through a DataLoader under no_grad after step 0: the
    evaluation's indices, which its forwards took, are no training step's samples."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with detrace.trace(tmp_path / "a", rung="semantic"):
        for step in range(3):
            model(torch.full((BATCH, 1), float(step))).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                model.eval()
                with torch.no_grad():
                    for held_out in DataLoader(Indexed(), batch_size=8):
                        model(held_out)
                model.train()
    assert [batch_samples(tmp_path / "a", 0, step) for step in range(3)] == [(), (), ()]


def test_an_evaluation_that_iterates_its_loader_with_grad_enabled_gives_no_training_batch_its_samples(
        tmp_path: Path) -> None:
    """HF `Trainer`'s evaluation loop iterates its DataLoader with grad enabled and runs only the forward under
    no_grad: its last batch was left to the next training forward, which named the evaluation's samples (in a
    continuous run, not in one resumed after the evaluation: check-resume called HF's exact DDP resume
    'resume-changed-the-run', the data position differing). A batch another loader than the training's dispatched is
    the evaluation's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with detrace.trace(tmp_path / "a", rung="semantic"):
        for step in range(3):
            model(torch.full((BATCH, 1), float(step))).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                model.eval()
                for held_out in DataLoader(Indexed(), batch_size=8):
                    with torch.no_grad():
                        model(held_out)
                model.train()
    assert [batch_samples(tmp_path / "a", 0, step) for step in range(3)] == [(), (), ()]


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_a_plain_loop_skips_are_no_steps_samples(tmp_path: Path, workers: int) -> None:
    """A loop resumed mid-epoch skips the batches it trained before with itertools.islice: the loader dispatched
    and handed them out, and the first step's samples are the batch it trains on, not the first one skipped (before:
    a run resumed this way named other samples than the continuous run, and check-resume --native called an exact
    resume 'resume-changed-the-run', the data position differing)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0))
    everything = [[int(x) for x in batch.flatten()] for batch in loader]
    loader.generator.manual_seed(0)  # type: ignore[union-attr]
    with detrace.trace(tmp_path / "a", rung="semantic"):
        for batch in itertools.islice(loader, 2, 5):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [list(batch_samples(tmp_path / "a", 0, step)) for step in range(3)] == everything[2:5]


def test_a_teachers_forward_leaves_the_batchs_samples_to_the_student(tmp_path: Path) -> None:
    """A frozen teacher called under no_grad on the batch before the student: the samples follow the student's
    batch, the one the step trains on (before, the teacher's call took them and the student's had none), in each
    epoch (the next epoch's iterator of the same DataLoader is no other loader: the teacher's first forward there is
    no evaluation)."""
    from detrace.tracefile import read_rank

    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(1, 1).requires_grad_(False), torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    loader = DataLoader(Indexed(), batch_size=BATCH)
    with detrace.trace(tmp_path / "a", rung="semantic"):
        for batch in itertools.chain(loader, loader):
            with torch.no_grad():
                target = teacher(batch)
            torch.nn.functional.mse_loss(student(batch), target).backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = read_rank(tmp_path / "a", 0).table.to_pylist()
    assert not [r for r in rows if r["phase"] == "evaluation"]
    for step in (0, 7):  # the first step of each epoch
        data = [(r["name"], r["occurrence"]) for r in rows if r["phase"] == "data" and r["step"] == step]
        assert data == [("batch", 0), ("batch", 1), ("samples", 0)]
        assert list(batch_samples(tmp_path / "a", 0, step)) == [0, 1, 2]
