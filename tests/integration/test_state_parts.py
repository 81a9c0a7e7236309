"""The tracer digests the training state part by part as the optimizer step after a stop point begins
(detrace.record.rungs.state_parts), in this process: two loops that reach that point with the same bits give the
same digests, and each part changes only its own digest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import detrace
from detrace.tracefile.state_parts import RECORDED, StateParts, read_state_parts


def _loop(out: Path, *, scheduler_steps: int = 0, lr: float = 0.1, seed: int = 0) -> StateParts:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for _ in range(scheduler_steps):  # a scheduler that is somewhere else (the lr is set back: only its state)
        optimizer.step()  # (no gradient: no update)
        scheduler.step()
    for group in optimizer.param_groups:  # (the scheduler's base lr stays)
        group["lr"] = lr
    torch.manual_seed(seed)
    with detrace.trace(out):
        for _ in range(3):
            model(torch.ones(3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    records = read_state_parts(out)
    assert [(r.step, r.rank, r.optimizer) for r in records] == [(2, 0, 0)]  # once, at the step after 2 completed
    return records[0]


def test_each_part_has_its_own_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_STATE_AT", "2")
    base = _loop(tmp_path / "a")
    assert base == _loop(tmp_path / "b")  # the same bits, the same digests (Python's RNG is not drawn from)
    assert set(base.parts) == set(RECORDED) and base.parts["CUDA RNG states"] is None
    assert base.shown == {"param groups": "lr 0.1, weight decay 0.01", "scheduler": "LambdaLR at its step 0"}
    changed = {"scheduler": _loop(tmp_path / "c", scheduler_steps=2), "param groups": _loop(tmp_path / "d", lr=0.2),
               "torch RNG state": _loop(tmp_path / "e", seed=1)}
    assert {p for p in RECORDED if changed["scheduler"].parts[p] != base.parts[p]} == {"scheduler"}
    assert changed["scheduler"].shown["scheduler"] == "LambdaLR at its step 2"
    # another learning rate made other parameters at the first two steps (from the same gradients: a linear model)
    assert {p for p in RECORDED if changed["param groups"].parts[p] != base.parts[p]} == {"param groups", "parameters"}
    assert changed["param groups"].shown["param groups"] == "lr 0.2, weight decay 0.01"
    assert {p for p in RECORDED if changed["torch RNG state"].parts[p] != base.parts[p]} == {"torch RNG state"}


def test_no_stop_point_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETRACE_STATE_AT", raising=False)
    with detrace.trace(tmp_path / "run"):
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(3)).sum().backward()
            optimizer.step()
    assert read_state_parts(tmp_path / "run") == []


def test_the_order_of_a_state_dicts_keys_is_not_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state restored through torch.distributed.checkpoint lists its keys in another order (sorted): the same
    bits, the same digests."""
    monkeypatch.setenv("DETRACE_STATE_AT", "2")
    base = _loop(tmp_path / "a")
    original = torch.optim.AdamW.step

    def reordered(self: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
        for group in self.param_groups:
            items = sorted(group.items(), reverse=True)
            group.clear()
            group.update(items)
        for state in self.state.values():
            items = sorted(state.items(), reverse=True)
            state.clear()
            state.update(items)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", reordered)
    assert _loop(tmp_path / "b") == base
