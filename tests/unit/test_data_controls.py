"""The resume contract's data controls, DETRACE_SKIP_STEPS and DETRACE_DATA_SHIFT, in TrainState's loop."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from detrace.errors import UsageError
from detrace.state import ResumableLoader, ResumableSampler, TrainState
from detrace.state.contract import batches_to_skip


class Indices(torch.utils.data.Dataset):
    """Sample i is the tensor [i]: a batch says which samples it holds."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def loop(steps: int) -> list[list[int]]:
    """A TrainState loop of `steps` steps over a ResumableLoader (batches of 2, 6 per epoch, no shuffle); the
    samples each step it ran was fed, in step order."""
    model = torch.nn.Linear(1, 1)
    loader = ResumableLoader(Indices(), sampler=ResumableSampler(12, shuffle=False), batch_size=2)
    state = TrainState(model=model, data=loader)
    start = state.resume_if_requested()
    batches = (batch for _ in itertools.count() for batch in loader)
    fed = []
    for step in range(start + 1, steps + 1):
        fed.append(next(batches).flatten().tolist())
        if state.end_of_step(step):
            break
    return fed


def first_samples(fed: list[list[int]]) -> list[int]:
    return [batch[0] for batch in fed]


def test_skip_steps_drops_the_batches_of_those_global_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_SKIP_STEPS", "2-3")
    # global steps 0, 1 get batches 0, 1; steps 2 and 3's batches (samples 4 and 6) are never trained on
    assert first_samples(loop(8)) == [0, 2, 8, 10, 0, 2, 4, 6]  # across the epoch end (6 batches per epoch)


def test_data_shift_feeds_the_batches_k_steps_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_DATA_SHIFT", "3")
    assert first_samples(loop(4)) == [6, 8, 10, 0]


def test_the_controls_apply_to_a_resumed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("DETRACE_STOP_AT", "4")
    assert first_samples(loop(8)) == [0, 2, 4, 6]
    monkeypatch.delenv("DETRACE_STOP_AT")
    monkeypatch.setenv("DETRACE_RESUME", "1")
    assert first_samples(loop(8)) == [8, 10, 0, 2]  # plain resume: global steps 4-7
    monkeypatch.setenv("DETRACE_SKIP_STEPS", "5")
    assert first_samples(loop(8)) == [8, 0, 2, 4]
    monkeypatch.setenv("DETRACE_SKIP_STEPS", "3-5")  # resumed inside the window: what is left of it, 4-5
    assert first_samples(loop(8)) == [0, 2, 4, 6]
    monkeypatch.delenv("DETRACE_SKIP_STEPS")
    monkeypatch.setenv("DETRACE_DATA_SHIFT", "2")  # the batches global steps 6.. had, from step 4
    assert first_samples(loop(8)) == [0, 2, 4, 6]


def test_malformed_controls_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("DETRACE_SKIP_STEPS", "5-2"), ("DETRACE_SKIP_STEPS", "x"), ("DETRACE_DATA_SHIFT", "0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=name):
            batches_to_skip(0, first=True)
        monkeypatch.delenv(name)


def test_data_that_cannot_skip_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_DATA_SHIFT", "1")
    state = TrainState(model=torch.nn.Linear(1, 1), data=ResumableSampler(4))
    with pytest.raises(UsageError, match="skip_batches"):
        state.resume_if_requested()
