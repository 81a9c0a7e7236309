"""Buffers are model state: a module buffer that differs between two runs is a divergence, found by `diff` (and so
by `check` and `locate`, which compare traces), like a parameter. The nondeterminism is real: a load statistic
updated with `index_put_(accumulate=True)` over many repeated indices, at more threads than cores
(`_tools.RACING_THREADS`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tools import RACING_THREADS
from torch import nn

import detrace
from detrace.analyze import diff
from detrace.tracefile import read_rank


class Router(nn.Module):
    """A linear layer that keeps an MoE-style expert-load statistic in a buffer (no gradient, no optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("load", torch.zeros(16))

    def forward(self, x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.load.index_put_((picks,), weights, accumulate=True)
        return self.linear(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()

    def forward(self, x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.router(x, picks, weights)


def _run(out: Path) -> None:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(0, 16, (1 << 20,), generator=gen)  # many repeated indices: the race strikes
    weights = torch.randn(1 << 20, generator=gen)
    with detrace.trace(out, rung="semantic"):
        for _ in range(2):
            loss = model(torch.ones(4, 8), picks, weights).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@pytest.fixture
def racing_threads() -> None:
    torch.set_num_threads(RACING_THREADS)


def test_a_buffer_is_recorded_with_the_parameters(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    _run(tmp_path / "a")
    rows = read_rank(tmp_path / "a", 0).table.to_pylist()
    buffers = [(r["step"], r["phase"], r["name"]) for r in rows if r["role"] == "buffer"]
    assert buffers == [(0, "optimizer", "router.load"), (1, "optimizer", "router.load")]


@pytest.mark.race
@pytest.mark.usefixtures("racing_threads")
def test_buffer_only_nondeterminism_is_found(tmp_path: Path) -> None:
    _run(tmp_path / "a")
    _run(tmp_path / "b")
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.verdict == "diverged"
    first = result.first
    assert first is not None
    assert (first.step, first.phase, first.name, first.role, first.kind, first.origin) == (
        0, "optimizer", "router.load", "buffer", "numeric", True)
