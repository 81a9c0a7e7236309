"""An evaluation is a phase of its own: forward passes of the trained model in eval mode with grad disabled belong to
the step they follow, a run that evaluates where another does not (a continuous run at the stop step) is no
divergence, and an evaluation both runs ran is compared: a nondeterministic one is still found."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import detrace
from detrace.analyze import certify, diff
from detrace.record import set_step
from detrace.tracefile import read_rank


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 4, generator=gen) for _ in range(6)]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, noise: bool = False) -> torch.Tensor:
        hidden = self.inner(x)
        if noise and not self.training:
            # The evaluation itself is nondeterministic (injected fault, named as such): a bit it flips differs from
            # one run to the next.
            hidden = hidden + torch.finfo(hidden.dtype).eps * float(torch.randint(0, 2**20, ()).item())
        return self.head(torch.relu(hidden))


def _evaluate(model: Model, data: list[torch.Tensor], *, noise: bool) -> None:
    model.eval()
    with torch.no_grad():
        for x in data[:2]:
            model(x, noise=noise)
    model.train()


def _run(out: Path, *, resume_at: int | None = None, evaluate_at: tuple[int, ...] = (2, 4),
         noise_seed: int | None = None, rung: str = "semantic") -> Path:
    """4 steps of training, an evaluation after the steps in `evaluate_at`; `resume_at`: a process that starts at
    that global step from the continuous run's state there (it runs no step before, nor their evaluations)."""
    data = _data()
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 0
    if resume_at is not None:  # bring the state to the stop step untraced, as a checkpoint would
        for i in range(resume_at):
            nn.functional.mse_loss(model(data[i]), torch.zeros(8, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        first = resume_at
    if noise_seed is not None:
        torch.manual_seed(noise_seed)
    with detrace.trace(out, rung=rung):
        if resume_at is not None:
            set_step(resume_at)
        for i in range(first, 4):
            nn.functional.mse_loss(model(data[i]), torch.zeros(8, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if i + 1 in evaluate_at:
                _evaluate(model, data, noise=noise_seed is not None)
    return out


def test_an_evaluation_belongs_to_the_step_it_follows(tmp_path: Path) -> None:
    rows = read_rank(_run(tmp_path / "a"), 0).table.to_pylist()
    evaluation = [(r["step"], r["name"], r["role"]) for r in rows if r["phase"] == "evaluation"]
    # After 2 and 4 optimizer steps: the trailing work of steps 1 and 3; inputs and outputs of each forward.
    assert evaluation == [(1, "batch", "input"), (1, "batch", "output")] * 2 + [(3, "batch", "input"),
                                                                                (3, "batch", "output")] * 2
    assert {r["step"] for r in rows} == {0, 1, 2, 3}  # 4 steps, not one more for the evaluation
    assert [r["step"] for r in rows if r["phase"] == "data"] == [0, 1, 2, 3]


def test_an_evaluation_at_the_stop_step_is_no_divergence(tmp_path: Path) -> None:
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", resume_at=2)
    result = diff(a, b)
    assert result.verdict == "identical", result.first
    assert ("compared apart from the training, by identity: evaluations: 4 records in A, 4 in B, 4 in both, every "
            "bit equal") in result.notes  # the evaluation after step 4, in both runs


def test_one_run_evaluating_where_the_other_does_not_is_no_divergence(tmp_path: Path) -> None:
    result = diff(_run(tmp_path / "a"), _run(tmp_path / "b", evaluate_at=()))
    assert result.verdict == "identical", result.first
    assert ("compared apart from the training, by identity: evaluations: 8 records in A, 0 in B, 0 in both"
            in result.notes)


@pytest.mark.parametrize("rung", ["semantic", "op"])
def test_a_nondeterministic_evaluation_is_found(tmp_path: Path, rung: str) -> None:
    a = _run(tmp_path / "a", noise_seed=1, rung=rung)
    b = _run(tmp_path / "b", noise_seed=2, rung=rung)
    result = diff(a, b)
    assert result.verdict == "diverged"
    first = result.first
    assert first is not None and (first.step, first.phase, first.kind) == (1, "evaluation", "numeric")
    if rung == "op":  # the op that made the difference, inputs equal
        assert first.origin and first.name == "aten.randint.low" and first.module == ""  # the draw the eval made
    else:  # the evaluation's output; its input batch was equal
        assert first.origin and (first.name, first.role) == ("batch", "output")


def test_training_under_no_grad_in_train_mode_is_no_evaluation(tmp_path: Path) -> None:
    """A frozen model (requires_grad off) or a forward in train mode under no_grad is the step's own work."""
    torch.manual_seed(0)
    model, frozen = Model(), Model().eval().requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with detrace.trace(tmp_path / "t", rung="semantic"):
        for x in _data()[:2]:
            with torch.no_grad():
                target = frozen(x)  # a teacher's, a frozen encoder's forward
                model(x)  # a generation in train mode
            nn.functional.mse_loss(model(x), target).backward()
            optimizer.step()
    rows = read_rank(tmp_path / "t", 0).table.to_pylist()
    assert not [r for r in rows if r["phase"] == "evaluation"]
    assert [r["step"] for r in rows if r["phase"] == "data"] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_frozen_copy_evaluated_after_the_step_is_an_evaluation(tmp_path: Path, mode: str) -> None:
    """An EMA copy (requires_grad off, in train mode as deepcopy leaves it, or in eval mode), evaluated under no_grad
    after steps 2 and 4: its forward is no training step's input, and no step begins after the last one."""
    torch.manual_seed(0)
    model = Model()
    ema = copy.deepcopy(model).requires_grad_(False).train(mode == "train")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    with detrace.trace(tmp_path / "t", rung="semantic"):
        for i in range(4):
            nn.functional.mse_loss(model(data[i]), torch.zeros(8, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for averaged, current in zip(ema.parameters(), model.parameters(), strict=True):
                    averaged.lerp_(current, 0.1)
                if (i + 1) % 2 == 0:
                    ema(data[5])
    rows = read_rank(tmp_path / "t", 0).table.to_pylist()
    assert [(r["step"], r["role"]) for r in rows if r["phase"] == "evaluation"] == [
        (1, "input"), (1, "output"), (3, "input"), (3, "output")]
    assert {r["step"] for r in rows} == {0, 1, 2, 3}
    assert [r["step"] for r in rows if r["phase"] == "data"] == [0, 1, 2, 3]


def _distill(out: Path, *, teacher_from: int, resume_at: int | None = None, rung: str = "semantic",
             steps: str = "all") -> Path:
    """4 steps of a student; from step `teacher_from` (counted from 1) on, a frozen teacher in eval mode runs under
    no_grad on the step's batch before the student (a distillation switched on late); `resume_at`: a process that
    starts at that global step from the continuous run's state there, its teacher's first call before any step."""
    data = _data()
    torch.manual_seed(0)
    teacher, student = Model().eval().requires_grad_(False), Model()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)

    def step(i: int) -> None:
        target = torch.zeros(8, 1)
        if i + 1 >= teacher_from:
            with torch.no_grad():
                target = teacher(data[i])
        nn.functional.mse_loss(student(data[i]), target).backward()
        optimizer.step()
        optimizer.zero_grad()

    first = resume_at or 0
    for i in range(first):  # the state at the stop step, untraced, as a checkpoint would bring it
        step(i)
    with detrace.trace(out, rung=rung, steps=steps):
        if resume_at is not None:
            set_step(resume_at)
        for i in range(first, 4):
            step(i)
    return out


@pytest.mark.parametrize("rung", ["semantic", "op"])
def test_a_teacher_switched_on_after_a_step_is_the_steps_work(tmp_path: Path, rung: str) -> None:
    """A teacher first called after an optimizer step is taken for an evaluation until the student's forward on the
    same batch shows it was the step's work: its records move into that step, as a process resumed there (whose
    teacher runs before any step) records them, and the two runs compare identical (before: a structural
    divergence at the resumed run's first step, and check-resume said resume-changed-the-run)."""
    a = _distill(tmp_path / "a", teacher_from=3, rung=rung)
    rows = read_rank(a, 0).table.to_pylist()
    assert not [r for r in rows if r["phase"] == "evaluation"]
    assert [r["step"] for r in rows if r["phase"] == "data"] == [0, 1, 2, 2, 3, 3]  # the teacher's batch, the student's
    assert certify(a).ok  # the records moved keep the sequence numbers dense
    for resume_at in (2, 3):
        result = diff(a, _distill(tmp_path / f"b{resume_at}", teacher_from=3, resume_at=resume_at, rung=rung))
        assert result.verdict == "identical", result.first
    # Recorded from the teacher's first step on (check-resume's window): its forward, made in the step before, is
    # kept by the window of the step it belongs to.
    windowed = _distill(tmp_path / "w", teacher_from=3, rung=rung, steps="2-3")
    assert [r["step"] for r in read_rank(windowed, 0).table.to_pylist() if r["phase"] == "data"] == [2, 2, 3, 3]
    result = diff(windowed, _distill(tmp_path / "wb", teacher_from=3, resume_at=2, rung=rung, steps="2-3"))
    assert result.verdict == "identical", result.first


def test_a_frozen_copy_evaluated_on_another_batch_stays_an_evaluation(tmp_path: Path) -> None:
    """An EMA copy evaluated after a step on a validation batch, then the next step's training forward on its own:
    the held evaluation is let go as one (not moved into the training), its outputs included."""
    torch.manual_seed(0)
    model = Model()
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    with detrace.trace(tmp_path / "t", rung="semantic"):
        for i in range(3):
            nn.functional.mse_loss(model(data[i]), torch.zeros(8, 1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                ema(data[5])
                ema(data[4])  # a second validation batch: the loop of an evaluation
    rows = read_rank(tmp_path / "t", 0).table.to_pylist()
    assert [(r["step"], r["role"]) for r in rows if r["phase"] == "evaluation"] == [
        (step, role) for step in range(3) for role in ("input", "output") * 2]
    assert [r["step"] for r in rows if r["phase"] == "data"] == [0, 1, 2]


def _validate_in_train_mode(out: Path, *, resume_at: int | None = None) -> tuple[Path, list[list[int]]]:
    """4 steps over a shuffled training DataLoader; after steps 2 and 4 a validation DataLoader iterated with grad
    enabled, its forward under no_grad, the model left in train mode (model.eval() forgotten). `resume_at`: a
    process that starts at that global step from the continuous run's state there. Returns the trained batches'
    sample indices."""
    torch.manual_seed(0)
    train_set = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    val_set = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = torch.utils.data.DataLoader(train_set, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches: list[list[int]] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        batches.append([int((train_set.tensors[0] == row).all(1).nonzero()) for row in x])
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    first = resume_at or 0
    batch_iter = iter(loader)
    for _ in range(first):  # the state at the stop step, untraced, as a checkpoint would bring it
        step(*next(batch_iter))
    with detrace.trace(out, rung="semantic"):
        if resume_at is not None:
            set_step(resume_at)
        for i in range(first, 4):
            step(*next(batch_iter))
            if (i + 1) % 2 == 0:
                for vx, _ in torch.utils.data.DataLoader(val_set, batch_size=4):
                    with torch.no_grad():
                        model(vx)
    return out, batches


def test_a_validation_loader_read_in_train_mode_is_an_evaluation(tmp_path: Path) -> None:
    """A forward with grad disabled on a batch of another DataLoader than the training's is an evaluation even in
    train mode: before, each validation forward began the next step's work (a step more at the end of the run, the
    validation's indices among the next step's samples), and a run resumed after the validation differed from the
    continuous one in structure."""
    from detrace.investigate.ablate import batch_samples

    a, batches = _validate_in_train_mode(tmp_path / "a")
    rows = read_rank(a, 0).table.to_pylist()
    assert {r["step"] for r in rows if r["phase"] != "final"} == {0, 1, 2, 3}
    assert [(r["step"], r["role"]) for r in rows if r["phase"] == "evaluation"] == [
        (step, role) for step in (1, 3) for role in ("input", "output") * 2]
    assert [list(batch_samples(a, 0, step)) for step in range(4)] == batches
    result = diff(a, _validate_in_train_mode(tmp_path / "b", resume_at=2)[0])
    assert result.verdict == "identical", result.first
