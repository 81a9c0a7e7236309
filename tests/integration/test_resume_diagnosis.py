"""What check-resume says a resume forgot, from real traces in process: step K's input batch holds the same
samples when only a random augmentation differs (HF's models take the labels with the inputs), so the data position
is not blamed for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import detrace
from detrace.analyze import diff
from detrace.investigate.check_resume import compare_parts
from detrace.report.meaning import forgotten


class Classifier(torch.nn.Module):
    """Takes the batch the way HF's models do: the inputs and their labels, and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.linear(pixel_values), labels)


def _train(out: Path, *, augmentation: int, first_label: int = 0) -> None:
    """Two steps; each batch's labels name its samples, its pixels get a random augmentation: at step 1 drawn from a
    generator seeded with `augmentation` (a resume after step 1 that does not restore it); `first_label` shifts
    step 1's labels (other samples)."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with detrace.trace(out, rung="semantic"):
        for step in range(2):
            draws = torch.Generator().manual_seed(augmentation if step else 0)
            labels = (torch.arange(6) + step + (first_label if step else 0)) % 3
            pixels = labels[:, None].float().expand(6, 4) + torch.rand(6, 4, generator=draws)
            model(pixel_values=pixels, labels=labels).backward()
            optimizer.step()
            optimizer.zero_grad()


def _data_position(tmp_path: Path, resumed: str) -> tuple[bool | None, str | None]:
    """The data position as compare_parts finds it at step 1 (the continuous run against `resumed`), and what the
    resume forgot."""
    result = diff(tmp_path / "continuous", tmp_path / resumed)
    assert result.verdict == "diverged" and result.first is not None and result.first.phase == "data"
    parts = compare_parts(tmp_path / "continuous", tmp_path / "continuous", tmp_path / resumed, 1, result)
    [data] = [c for c in parts if c.part == "data position"]
    return data.equal, forgotten(result.first, [c.part for c in parts if c.equal is False],
                                 [c.part for c in parts if c.equal])


def test_the_same_samples_augmented_otherwise_are_not_another_data_position(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_STATE_AT", "1")  # each run digests its state as step 1 begins, as check-resume asks
    _train(tmp_path / "continuous", augmentation=1)
    _train(tmp_path / "augmented", augmentation=2)
    _train(tmp_path / "other", augmentation=1, first_label=1)
    equal, said = _data_position(tmp_path, "augmented")
    assert equal is True and said is not None and said.startswith("the same samples arrived, but their random "
                                                                   "augmentation is not the continuous run's")
    equal, said = _data_position(tmp_path, "other")  # other labels: other samples
    assert equal is False and said is not None and said.startswith("the data order or position is not")
