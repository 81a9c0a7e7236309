"""The synthetic token stream: a pure function of (seed, index), learnable, in range."""

from __future__ import annotations

import pytest
import torch

from detrace.errors import UsageError
from detrace.workload.corpus import SyntheticTokens, split_batch


def _data(seed: int = 0) -> SyntheticTokens:
    return SyntheticTokens(num_samples=64, seq_len=16, vocab_size=32, seed=seed)


def test_sample_depends_only_on_seed_and_index() -> None:
    a, b = _data(), _data()
    backwards = [b[i] for i in reversed(range(len(b)))][::-1]
    assert all(torch.equal(a[i], backwards[i]) for i in range(len(a)))
    assert not torch.equal(_data(seed=1)[0], a[0])


def test_tokens_follow_the_grammar() -> None:
    data = _data()
    sample = data[5]
    assert sample.shape == (18,) and sample.dtype == torch.long
    assert int(sample.min()) >= 0 and int(sample.max()) < 32
    for prev, nxt in zip(sample[:-1].tolist(), sample[1:].tolist(), strict=True):
        assert nxt in data.successors[prev].tolist()


def test_split_batch() -> None:
    batch = torch.stack([_data()[i] for i in range(4)])
    inputs, targets = split_batch(batch)
    assert inputs.shape == (4, 16) and targets.shape == (4, 17)
    assert torch.equal(targets[:, :-1], batch[:, 1:-1]) and torch.equal(inputs, batch[:, :16])


def test_errors() -> None:
    with pytest.raises(UsageError):
        SyntheticTokens(num_samples=0, seq_len=4, vocab_size=8, seed=0)
    with pytest.raises(IndexError):
        _data()[64]
