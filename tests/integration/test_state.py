"""The parts of exact resume, one process: the pickle-free state codec, RNG capture, the resumable sampler
and loader (with real DataLoader workers), and TrainState's environment contract."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from _tools import close_loader_workers
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace.errors import CheckpointError, UsageError
from detrace.state import ResumableLoader, ResumableSampler, TrainState, rng, sample_seed, seeded_rngs, tree
from detrace.state.contract import resume_requested

# --- the codec --------------------------------------------------------------------------------------------

json_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
keys = st.text(max_size=8) | st.integers() | st.sampled_from(["__tensor__", "__tuple__", "__dict__"])
trees = st.recursive(
    json_leaves | st.builds(torch.randn, st.integers(0, 3)),
    lambda children: st.lists(children, max_size=3)
    | st.lists(children, max_size=3).map(tuple)
    | st.dictionaries(keys, children, max_size=3),
    max_leaves=12,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(trees)
@settings(max_examples=60, deadline=None)
def test_codec_round_trips_any_state_tree_through_json(value: object) -> None:

    skeleton, tensors = tree.split(value, "p")
    assert all(key == "p" or key.startswith("p.") for key in tensors)
    assert sorted(tree.tensor_keys(skeleton)) == sorted(tensors)
    assert _same(tree.join(json.loads(json.dumps(skeleton)), tensors), value)


def test_codec_refuses_what_only_pickle_could_store() -> None:
    with pytest.raises(CheckpointError, match=r"'opt\.lr_fn'.*function"):
        tree.split({"opt": {"lr_fn": lambda step: step}}, "")


def test_codec_refuses_a_cyclic_or_too_deep_state_in_one_sentence(tmp_path: Path) -> None:
    cyclic: dict = {"lr": 0.1}
    cyclic["self"] = cyclic
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    state = TrainState(model=torch.nn.Linear(2, 2), extra={"cyclic": cyclic})
    with pytest.raises(CheckpointError, match=r"cannot save 'rank0\.extra\.cyclic\.self': it contains itself"):
        state.save(tmp_path)
    state = TrainState(model=torch.nn.Linear(2, 2), extra={"deep": deep})
    with pytest.raises(CheckpointError, match="nested deeper than 64 levels"):
        state.save(tmp_path)
    shared = {"a": 1}  # one object reached twice is no cycle
    assert tree.split({"x": shared, "y": [shared]}, "")[0] == {"x": {"a": 1}, "y": [{"a": 1}]}


@pytest.mark.parametrize(("parts", "message"), [
    ({"model": None}, "model must be a torch.nn.Module, not NoneType"),
    ({"optimizer": "model"}, "optimizer must be a torch.optim.Optimizer, not Linear"),
    ({"extra": [1]}, "extra must be a dict of named state"),
    ({"extra": {1: 2}}, "extra must have str keys"),
    ({"generators": [None]}, "generators must be torch.Generators, and item 0 is a NoneType"),
    ({"generators": None}, "generators must be a sequence of torch.Generator, not NoneType"),
])
def test_train_state_refuses_wrong_parts_at_construction(parts: dict, message: str) -> None:
    model = torch.nn.Linear(2, 2)
    parts = {"model": model, **{key: model if value == "model" else value for key, value in parts.items()}}
    with pytest.raises(UsageError, match=message):
        TrainState(**parts)


def test_accelerate_register_refuses_what_is_not_an_accelerator() -> None:
    pytest.importorskip("accelerate")
    from detrace.integrations.accelerate import register

    with pytest.raises(UsageError, match="register needs the Accelerator, not NoneType"):
        register(None)  # type: ignore[arg-type]


def _train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 2)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_save_before_end_of_step_is_refused_not_one_step_off(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=optimizer)
    _train_one_step(model, optimizer)
    with pytest.raises(UsageError, match="would be named after step 0, but the optimizer stepped 1 more time since"):
        state.save(tmp_path)  # the loop saved before state.end_of_step(1)
    assert not (tmp_path / "latest").exists()
    state.end_of_step(1)
    assert state.save(tmp_path).name == "step-00000001"
    _train_one_step(model, optimizer)
    assert state.save(tmp_path, step=2).name == "step-00000002"  # or the save takes the step
    with pytest.raises(UsageError, match="step must be a number of completed steps"):
        state.save(tmp_path, step=-1)
    assert TrainState(model=model, optimizer=optimizer).load(tmp_path) == 2


def test_accelerate_save_state_before_end_of_step_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from detrace.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    net = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = register(accelerator)
    _train_one_step(model, optimizer)
    with pytest.raises(UsageError, match=r"call state\.end_of_step"):
        accelerator.save_state(str(tmp_path / "early"))
    state.end_of_step(1)
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / "detrace" / "step-00000001").is_dir()


class _NoisyPoints(torch.utils.data.Dataset):
    """Fixed points; each read adds noise drawn from torch's global RNG (an augmentation)."""

    def __init__(self) -> None:
        self.x = torch.randn(20, 8, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index] + 0.1 * torch.randn(8)


def _accelerate_loop(*, stateful: bool, workers: int, total: int = 8) -> tuple[dict[int, float], list[torch.Tensor]]:
    """An accelerate loop as its examples write it (a shuffling DataLoader prepared with the model, dropout), the
    prepared loader handed to `register` as it is: the losses by step and the final parameters."""
    from accelerate import Accelerator, DataLoaderConfiguration

    from detrace.integrations.accelerate import register

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    # A generator of its own: the sampler's order then comes from a generator state the loader does not save.
    loader = torch.utils.data.DataLoader(_NoisyPoints(), batch_size=4, shuffle=True, num_workers=workers,
                                         generator=torch.Generator().manual_seed(5))
    model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), loader)
    state = register(accelerator, data=loader)  # the prepared loader, as it is
    step = state.resume_if_requested()
    losses = {}
    while step < total:
        for x in loader:
            loss = model(x).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses[step] = loss.item()
            if state.end_of_step(step) or step == total:
                break
        else:
            continue  # the epoch ended: the next one
        break
    close_loader_workers(loader.base_dataloader)
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize(("stateful", "stop", "workers"), [(False, 5, 0), (True, 3, 2)],
                         ids=["plain-epoch-end", "stateful-mid-epoch-2-workers"])
def test_accelerate_resumes_its_prepared_loader_at_its_position(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stateful: bool, stop: int, workers: int) -> None:
    """(The plain loader with 2 workers: tests/e2e/test_integrations_accelerate.py.)"""
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata")
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    losses, params = _accelerate_loop(stateful=stateful, workers=workers)
    monkeypatch.setenv("DETRACE_STOP_AT", str(stop))
    before, _ = _accelerate_loop(stateful=stateful, workers=workers)
    monkeypatch.delenv("DETRACE_STOP_AT")
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(tmp_path / f"checkpoint-{stop}"))
    after, resumed = _accelerate_loop(stateful=stateful, workers=workers)
    assert sorted(before) == list(range(1, stop + 1)) and sorted(after) == list(range(stop + 1, 9))
    assert {**before, **after} == losses
    assert all(torch.equal(a, b) for a, b in zip(params, resumed, strict=True))


# --- RNG ---------------------------------------------------------------------------------------------------


def _draws(generator: torch.Generator) -> tuple:
    numpy_draws = float(np.random.rand()), np.random.randn(3).tolist()
    return random.random(), numpy_draws, torch.rand(2).tolist(), torch.rand(2, generator=generator).tolist()


def test_every_rng_is_captured_and_restored() -> None:
    generator = torch.Generator().manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state, which must survive too
    state = rng.capture([generator])
    first = _draws(generator)
    _draws(generator)
    rng.restore(state, [generator])
    assert _draws(generator) == first
    with pytest.raises(CheckpointError, match=r"1 explicit generators.*given 0"):
        rng.restore(state, [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rng_states_are_captured_and_restored() -> None:
    torch.cuda.init()
    state = rng.capture()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(4, device="cuda").tolist()
    rng.restore(state)
    assert torch.rand(4, device="cuda").tolist() == first


# --- the sampler -------------------------------------------------------------------------------------------


@given(
    n=st.integers(1, 40), replicas=st.integers(1, 4), drop_last=st.booleans(), shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
@settings(max_examples=80, deadline=None)
def test_sampler_shards_like_distributed_sampler(n: int, replicas: int, drop_last: bool, shuffle: bool, epoch: int):
    if drop_last and n < replicas:
        return
    for rank in range(replicas):
        sampler = ResumableSampler(n, shuffle=shuffle, seed=5, num_replicas=replicas, rank=rank, drop_last=drop_last)
        reference = torch.utils.data.DistributedSampler(
            range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        reference.set_epoch(epoch)
        assert sampler.indices(epoch) == list(reference)
        assert len(sampler) == len(reference)


def _take(sampler: ResumableSampler, count: int) -> list[int]:
    """`count` indices from the sampler, iterating it again at each epoch's end, as a training loop does."""
    out: list[int] = []
    while len(out) < count:
        for index in sampler:
            out.append(index)
            if len(out) == count:
                break
    return out


@given(n=st.integers(2, 30), stop=st.integers(0, 70))
@settings(max_examples=60, deadline=None)
def test_sampler_resumes_anywhere_across_epochs(n: int, stop: int) -> None:
    stream = _take(ResumableSampler(n, seed=1), 3 * n)
    stopped = ResumableSampler(n, seed=1)
    head = _take(stopped, min(stop, 3 * n))
    resumed = ResumableSampler(n, seed=1)
    resumed.load_state_dict(stopped.state_dict())
    assert head + _take(resumed, 3 * n - len(head)) == stream


def test_sampler_refuses_a_state_of_another_configuration() -> None:
    state = ResumableSampler(10, num_replicas=2, rank=1).state_dict()
    with pytest.raises(CheckpointError, match=r"num_replicas=2.*num_replicas=4"):
        ResumableSampler(10, num_replicas=4, rank=1).load_state_dict(state)


def test_sampler_and_loader_arguments_are_checked() -> None:
    with pytest.raises(UsageError, match="rank 2 is not one of num_replicas=2"):
        ResumableSampler(10, num_replicas=2, rank=2)
    with pytest.raises(UsageError, match="sets the DataLoader's shuffle itself"):
        ResumableLoader([], sampler=ResumableSampler(3), batch_size=1, shuffle=True)
    with pytest.raises(UsageError, match="batches of 4 leave nothing of 3 samples"):
        ResumableLoader([], sampler=ResumableSampler(3), batch_size=4, drop_last=True)


# --- the loader --------------------------------------------------------------------------------------------


class Augmented(torch.utils.data.Dataset):
    """Random augmentation from torch, NumPy and Python's RNGs, drawn wherever the sample is loaded."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)


def _epochs(loader: ResumableLoader, batches: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    while len(out) < batches:
        for batch in loader:
            out.append(batch)
            if len(out) == batches:
                break
    return out


@pytest.mark.parametrize("stop", [2, 3], ids=["mid-epoch", "epoch-boundary"])
def test_loader_with_two_workers_resumes_samples_and_augmentation_exactly(stop: int) -> None:
    def loader(workers: int) -> ResumableLoader:
        sampler = ResumableSampler(10, seed=4)
        return ResumableLoader(Augmented(), sampler=sampler, batch_size=3, num_workers=workers,
                               multiprocessing_context="fork" if workers else None)

    # 10 samples in batches of 3: batches 1-4 are epoch 0 (the 4th holds one sample), 5-8 epoch 1.
    continuous = _epochs(loader(2), 6)
    first = loader(2)
    head = _epochs(first, stop)
    resumed = loader(2)
    resumed.load_state_dict(first.state_dict())
    tail = _epochs(resumed, 6 - stop)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, continuous, strict=True))
    # Per-sample seeding makes the bits independent of the number of workers, too.
    assert all(torch.equal(a, b) for a, b in zip(_epochs(loader(0), 6), continuous, strict=True))
    # ... and different from epoch to epoch for the same sample.
    epoch0 = {int(row[0]): row[1:] for batch in continuous[:4] for row in batch}
    epoch1 = {int(row[0]): row[1:] for batch in continuous[4:] for row in batch}
    assert all(not torch.equal(epoch0[index], epoch1[index]) for index in epoch1)


def _masking_collate(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collator with randomness of its own (as a masked-LM collator draws its masks)."""
    batch = torch.stack(samples)
    return torch.cat([batch, torch.rand(len(samples), 1, dtype=torch.float64)], dim=1)


def test_a_collators_randomness_resumes_exactly_with_any_workers() -> None:
    """Each batch's collate_fn runs under a seed of (seed, epoch, its samples' indices), as each sample does."""
    def loader(workers: int) -> ResumableLoader:
        return ResumableLoader(Augmented(), sampler=ResumableSampler(10, seed=4), batch_size=3, num_workers=workers,
                               collate_fn=_masking_collate, multiprocessing_context="fork" if workers else None)

    continuous = _epochs(loader(2), 6)
    first = loader(2)
    head = _epochs(first, 3)
    resumed = loader(0)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head + _epochs(resumed, 3), continuous, strict=True))
    masks = [row[-1].item() for batch in continuous for row in batch]
    assert len(set(masks)) == len(masks)  # drawn per batch and per row, not repeated


def test_loader_counts_what_the_loop_consumed_not_what_workers_prefetched() -> None:
    sampler = ResumableSampler(12, seed=0)
    loader = ResumableLoader(Augmented(), sampler=sampler, batch_size=2, num_workers=2,
                             multiprocessing_context="fork", prefetch_factor=2)
    _epochs(loader, 1)
    assert loader.state_dict()["sampler"]["position"] == 2


def test_loader_leaves_the_training_loops_rng_alone() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()
    _epochs(ResumableLoader(Augmented(), sampler=ResumableSampler(10), batch_size=4), 3)
    after = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist()
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_sample_seeds_differ_by_epoch_and_index_and_seed_every_rng() -> None:
    seeds = {sample_seed(0, epoch, index) for epoch in range(5) for index in range(50)}
    assert len(seeds) == 250
    with seeded_rngs(sample_seed(0, 1, 2)):
        first = torch.rand(()).item(), np.random.rand(), random.random()
    with seeded_rngs(sample_seed(0, 1, 2)):
        assert (torch.rand(()).item(), np.random.rand(), random.random()) == first


# --- TrainState's environment contract -------------------------------------------------------------------


def _state() -> TrainState:
    model = torch.nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      data=ResumableSampler(8), extra={"tokens": 0, "ema": torch.zeros(2)})


def test_environment_contract_stops_saves_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    state = _state()
    assert state.resume_if_requested() == 0
    assert not state.end_of_step(1)
    monkeypatch.setenv("DETRACE_STOP_AT", "2")
    state.extra["tokens"] = 64
    state.extra["ema"].fill_(3.0)
    next(iter(state.data))
    assert state.end_of_step(2)
    assert (tmp_path / "latest").read_text() == "step-00000002\n"

    monkeypatch.delenv("DETRACE_STOP_AT")
    monkeypatch.setenv("DETRACE_RESUME", "1")
    resumed = _state()
    assert resumed.resume_if_requested() == 2
    assert resumed.step == 2 and resumed.extra["tokens"] == 64 and resumed.extra["ema"].tolist() == [3.0, 3.0]
    assert resumed.data.position == 1
    monkeypatch.setenv("DETRACE_RESUME_CONTROL", "skip-data")
    skipped = _state()
    assert skipped.resume_if_requested() == 2 and skipped.data.position == 0
    # The same controls through load(), as the framework integrations use them; an unknown one is refused.
    assert _state().load(tmp_path, control="skip-data") == 2
    with pytest.raises(UsageError, match="'skip-all' is not a known negative control"):
        _state().load(tmp_path, control="skip-all")


def _adam_state(*, elastic: bool = False, model: torch.nn.Module | None = None) -> TrainState:
    torch.manual_seed(0)
    model = model or torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return TrainState(model=model, optimizer=optimizer, data=ResumableSampler(8), elastic=elastic,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 + s))


def _parts(state: TrainState) -> dict[str, list[torch.Tensor]]:
    """Each part DETRACE_RESTORE_PART replaces, as tensors, and the position of the data (which it keeps)."""
    assert state.optimizer is not None and state.scheduler is not None
    moments = [per[key] for per in state.optimizer.state.values() for key in sorted(per)]
    lr = [torch.tensor([group["lr"] for group in state.optimizer.param_groups]),
          torch.tensor([state.scheduler.last_epoch])]
    return {"weights": [p.detach().clone() for p in state.model.parameters()],
            "moments": [m.clone() for m in moments], "lr": lr, "data": [torch.tensor(state.data.position)]}


@pytest.mark.parametrize("elastic", [False, True])  # an elastic state keeps the optimizer's state by parameter name
@pytest.mark.parametrize("part", ["lr", "moments", "weights"])
def test_restore_part_takes_one_part_from_another_checkpoint(part: str, elastic: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("DETRACE_CKPT_EVERY", "2")
    state = _adam_state(elastic=elastic)
    assert state.resume_if_requested() == 0
    saved = {}
    for step in (1, 2, 3, 4):
        _train_one_step(state.model, state.optimizer)
        state.scheduler.step()
        next(iter(state.data))
        state.end_of_step(step)
        saved[step] = _parts(state)
    monkeypatch.delenv("DETRACE_CKPT_EVERY")
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(tmp_path / "step-00000004"))
    monkeypatch.setenv("DETRACE_RESTORE_PART", f"{part}:{tmp_path / 'step-00000002'}")
    resumed = _adam_state(elastic=elastic)
    assert resumed.resume_if_requested() == 4 and resumed.step == 4
    got = _parts(resumed)
    for name, tensors in got.items():
        want = saved[2 if name == part else 4][name]
        assert all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True)), name
    # Two checkpoints that differ in each part, so the comparison above tells them apart.
    assert all(not all(torch.equal(a, b) for a, b in zip(saved[2][name], saved[4][name], strict=True)) for name in got)


class _Chunked(torch.nn.Module):
    """A linear layer's weight as two chunks named by index, as a tensor-parallel layout names them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Module()
        self.lin.chunks = torch.nn.ParameterDict({str(j): torch.nn.Parameter(torch.ones(1, 2)) for j in range(2)})


def test_an_elastic_load_refuses_what_it_cannot_resume_in_one_sentence(tmp_path: Path) -> None:
    # a checkpoint of per-rank state (or torch's nested optimizer form) is not resumed as an elastic one
    _adam_state().save(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"was not saved as an elastic checkpoint .* resumes only on the mesh"):
        _adam_state(elastic=True).load(tmp_path / "plain")
    # an elastic checkpoint of an earlier detrace (its rank files did not say; its optimizer state is nested)
    version = _adam_state(elastic=True).save(tmp_path / "earlier")
    document = json.loads((version / "rank-0.json").read_text())
    del document["elastic"]
    (version / "rank-0.json").write_text(json.dumps(document))
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["files"]["rank-0.json"] = hashlib.sha256((version / "rank-0.json").read_bytes()).hexdigest()
    (version / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"saved by an earlier detrace, whose checkpoints hold the optimizer "
                                              r"state by parameter index: it resumes only on the mesh that wrote it"):
        _adam_state(elastic=True).load(version)
    # a model split into other parameters (chunks against a whole weight) is named as such, both ways
    _adam_state(elastic=True, model=_Chunked()).save(tmp_path / "chunks")
    with pytest.raises(CheckpointError, match=r"has tensor 'model\.lin\.weight' that .* does not hold \(it holds "
                                              r"'model\.lin\.chunks\.0' there: the model was split into other"):
        _adam_state(elastic=True, model=_Whole()).load(tmp_path / "chunks")
    _adam_state(elastic=True, model=_Whole()).save(tmp_path / "whole")
    with pytest.raises(CheckpointError, match=r"'model\.lin\.chunks\.0' that .* \(it holds 'model\.lin\.weight'"):
        _adam_state(elastic=True, model=_Chunked()).load(tmp_path / "whole")
    # an optimizer whose state torch's flattened form cannot take (LBFGS keeps lists) is refused in one sentence
    model = torch.nn.Linear(2, 2)
    lbfgs = torch.optim.LBFGS(model.parameters())
    lbfgs.step(lambda: _closure(model, lbfgs))
    with pytest.raises(CheckpointError, match=r"LBFGS's state does not fit .* save it without elastic=True"):
        TrainState(model=model, optimizer=lbfgs, elastic=True).save(tmp_path / "lbfgs", step=1)
    # the elastic form round-trips in one process: the optimizer's state by parameter name
    state = _adam_state(elastic=True)
    _train_one_step(state.model, state.optimizer)
    state.scheduler.step()
    state.save(tmp_path / "round", step=1)
    resumed = _adam_state(elastic=True)
    assert resumed.load(tmp_path / "round") == 1
    assert all(torch.equal(a, b) for a, b in zip(_parts(resumed)["moments"], _parts(state)["moments"], strict=True))
    assert _parts(resumed)["lr"][1].item() == 1


def _closure(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(torch.ones(1, 2)).sum()
    loss.backward()
    return loss


class _Whole(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2, bias=False)


@pytest.mark.parametrize(
    ("value", "message"),
    [("momentum:/x", "DETRACE_RESTORE_PART must be PART:PATH, PART one of lr, moments, weights, not 'momentum:/x'"),
     ("weights", "DETRACE_RESTORE_PART must be PART:PATH")],
)
def test_restore_part_refuses_what_it_cannot_apply(value: str, message: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    state = _state()
    state.end_of_step(1)
    state.save(tmp_path)
    monkeypatch.setenv("DETRACE_RESUME", "1")
    monkeypatch.setenv("DETRACE_RESTORE_PART", value)
    with pytest.raises(UsageError, match=message):
        _state().resume_if_requested()
    bare = TrainState(model=torch.nn.Linear(3, 2))
    bare.save(tmp_path / "bare", step=1)
    monkeypatch.setenv("DETRACE_RESTORE_PART", f"moments:{tmp_path}")
    with pytest.raises(UsageError, match="DETRACE_RESTORE_PART=moments needs an optimizer, and this TrainState has"):
        bare.load(tmp_path / "bare")


def test_restore_part_in_a_run_that_does_not_resume_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """#49.12: only the resume's load applies DETRACE_RESTORE_PART; a run that does not resume ignored it silently."""
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("DETRACE_RESTORE_PART", f"weights:{tmp_path}")
    with pytest.raises(UsageError, match=r"^DETRACE_RESTORE_PART=weights:.* takes a part of the state from a "
                                         r"checkpoint when the run resumes, and this run does not \(DETRACE_RESUME "
                                         r"is not 1 and DETRACE_RESUME_FROM is not set\)$"):
        _state().resume_if_requested()


def test_accelerate_refuses_restore_part_in_a_run_that_does_not_resume(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate's resume_if_requested ignored DETRACE_RESTORE_PART without a word when the run did not resume: the
    run trained on with none of the part it asked for. It is refused as TrainState's loop refuses it."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from detrace.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    net = torch.nn.Linear(2, 2)
    accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = register(accelerator)
    monkeypatch.setenv("DETRACE_RESTORE_PART", f"moments:{tmp_path}")
    with pytest.raises(UsageError, match=r"^DETRACE_RESTORE_PART=moments:.* takes a part of the state from a "
                                         r"checkpoint when the run resumes, and this run does not \(DETRACE_RESUME "
                                         r"is not 1 and DETRACE_RESUME_FROM is not set\)$"):
        state.resume_if_requested()
    monkeypatch.delenv("DETRACE_RESTORE_PART")
    assert state.resume_if_requested() == 0


@pytest.mark.parametrize("name", ["DETRACE_CKPT_EVERY", "DETRACE_STOP_AT"])
def test_a_save_variable_set_but_empty_is_refused(name: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """#49.12: DETRACE_CKPT_EVERY='' was taken as unset: the saves it asked for were never made, without a word."""
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv(name, "")
    with pytest.raises(UsageError, match=rf"^{name} must be a step number of at least 1, not '' \(set but empty: "
                                         r"give a step or unset it\)$"):
        _state().resume_if_requested()

def test_restore_part_refuses_a_sharded_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              free_port: Callable[[], int]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        state = TrainState(model=model, optimizer=optimizer)
        _train_one_step(model, optimizer)
        state.save(tmp_path, step=1)
        monkeypatch.setenv("DETRACE_RESTORE_PART", f"weights:{tmp_path}")
        with pytest.raises(CheckpointError, match=r"^DETRACE_RESTORE_PART cannot restore one part of a sharded state "
                                                  r"\(DTensors\): only a replicated or single-process one$"):
            state.load(tmp_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"DETRACE_RESUME": "yes"}, "DETRACE_RESUME must be 1 or 0"),
        ({"DETRACE_RESUME": "1"}, "DETRACE_CKPT_DIR must name the checkpoint directory"),
        ({"DETRACE_RESUME_CONTROL": "skip-everything"}, "'skip-everything' is not a known negative control"),
    ],
)
def test_environment_contract_errors(monkeypatch: pytest.MonkeyPatch, variables: dict, message: str) -> None:
    monkeypatch.delenv("DETRACE_CKPT_DIR", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=message):
        _state().resume_if_requested()


def test_stop_at_must_be_a_number_and_needs_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETRACE_CKPT_DIR", raising=False)
    monkeypatch.setenv("DETRACE_STOP_AT", "ten")
    with pytest.raises(UsageError, match="DETRACE_STOP_AT must be a step number of at least 1, not 'ten'"):
        _state().end_of_step(1)
    monkeypatch.setenv("DETRACE_STOP_AT", "1")
    with pytest.raises(UsageError, match="DETRACE_CKPT_DIR must name the checkpoint directory"):
        _state().end_of_step(1)


@pytest.mark.parametrize("value", ["ten", "0", "-3", "2.5"])
def test_stop_at_is_validated_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str) -> None:
    """m5: a bad DETRACE_STOP_AT was refused only after step 1 had run; the start refuses it now."""
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.delenv("DETRACE_RESUME", raising=False)
    monkeypatch.setenv("DETRACE_STOP_AT", value)
    with pytest.raises(UsageError, match=f"DETRACE_STOP_AT must be a step number of at least 1, not '{value}'"):
        _state().resume_if_requested()
    monkeypatch.setenv("DETRACE_STOP_AT", "4")
    monkeypatch.delenv("DETRACE_CKPT_DIR")
    with pytest.raises(UsageError, match="DETRACE_CKPT_DIR must name the checkpoint directory"):
        _state().resume_if_requested()


def test_resume_continues_the_tracers_step_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import detrace.record
    from detrace import _events

    assert _events.step_restored  # importing the tracer registers its clock
    clock: list[tuple[int, str]] = []
    monkeypatch.setattr(detrace.record, "set_step", lambda n, *, source: clock.append((n, source)))
    state = _state()
    state.step = 5
    state.save(tmp_path)
    _state().load(tmp_path)
    assert clock == [(5, "train_state")]


def test_loading_into_a_fresh_optimizer_is_no_optimizer_step(tmp_path: Path) -> None:
    """DCP's state_dict helpers initialise an optimizer that never stepped with a zero-lr `step()`. The
    global step hooks (detrace's tracer counts steps with them) and an LR scheduler's step wrapper must not
    see it: the tracer would end a step inside the load and record the load's own calls in the next."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def fresh(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return TrainState(model=model, optimizer=optimizer, scheduler=scheduler)

    saved = fresh(0)
    saved.model(torch.randn(4, 3)).sum().backward()
    saved.optimizer.step()
    saved.scheduler.step()
    saved.step = 1
    saved.save(tmp_path)

    seen: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda *_: seen.append("pre")),
               register_optimizer_step_post_hook(lambda *_: seen.append("post"))]
    try:
        resumed = fresh(1)
        scheduler_wrapper = resumed.optimizer.step
        assert not resumed.optimizer.state  # so torch's helpers do initialise it
        assert resumed.load(tmp_path) == 1
        assert seen == []
        # The optimizer is whole again: its scheduler's wrapper is back and a real step runs the hooks.
        assert resumed.optimizer.step == scheduler_wrapper and "step" in vars(resumed.optimizer)
        resumed.model(torch.randn(4, 3)).sum().backward()
        resumed.optimizer.step()
        assert seen == ["pre", "post"]
    finally:
        for handle in handles:
            handle.remove()
    assert resumed.optimizer.state_dict()["state"][0]["step"].item() == 2  # 1 loaded + 1 taken, no extra


def test_the_optimizer_and_model_controls_each_leave_out_their_part(tmp_path: Path) -> None:
    """skip-optimizer restores everything but the optimizer's per-parameter state (empty, as in a fresh optimizer;
    its param groups are restored); skip-model everything but the model (as this process had it)."""
    def state(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        return TrainState(model=model, optimizer=optimizer,
                          scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))

    saved = state(0)
    saved.model(torch.ones(3)).sum().backward()
    saved.optimizer.step()
    saved.scheduler.step()
    saved.step = 1
    saved.save(tmp_path)
    moments = saved.optimizer.state_dict()["state"]
    for control, model_kept, optimizer_kept in (("skip-optimizer", True, False), ("skip-model", False, True)):
        fresh = state(1)
        before = [p.detach().clone() for p in fresh.model.parameters()]
        assert fresh.load(tmp_path, control=control) == 1
        expected = saved.model.parameters() if model_kept else before
        assert all(map(torch.equal, fresh.model.parameters(), expected)), control
        restored = fresh.optimizer.state_dict()
        assert restored["param_groups"][0]["lr"] == 0.05  # the scheduler's learning rate, in both
        if optimizer_kept:
            assert all(torch.equal(restored["state"][i]["exp_avg"], moments[i]["exp_avg"]) for i in moments)
        else:
            assert restored["state"] == {}


def test_a_framework_that_restores_the_model_refuses_the_model_control(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_RESUME_CONTROL", "skip-model")
    assert resume_requested() == (False, "skip-model")
    with pytest.raises(UsageError, match="skip-model cannot be applied under Lightning, which restores the model"):
        resume_requested(framework="Lightning")
