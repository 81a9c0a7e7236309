"""The reference trainer, single process: its output, its determinism, its errors, and exact resume through
`detrace.TrainState`'s environment contract."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from detrace.errors import UsageError
from detrace.workload.train import TrainConfig, bits, main


@pytest.fixture(autouse=True)
def _restore_torch_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("DETRACE_CKPT_DIR", "DETRACE_STOP_AT", "DETRACE_RESUME", "DETRACE_RESUME_CONTROL", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)


def _steps(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("detrace.workload.train: preset=tiny")
    return [line for line in out if line.startswith("step ")]


def test_prints_one_line_per_step_with_exact_bits(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _steps(capsys, ["--steps", "3", "--dispatch", "fixed"])
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]
    fields = lines[0].split()  # step 0 loss <decimal> (<hex bits>) ...
    loss, exact = float(fields[3]), struct.unpack(">f", bytes.fromhex(fields[4][3:-1]))[0]
    assert abs(loss - exact) < 1e-5 and 4.0 < exact < 10.0
    # docs/workload.md quotes this run's first step as the CPUs it ran on print it: the line must be one of them
    doc = (Path(__file__).parents[2] / "docs" / "workload.md").read_text()
    quoted = doc.split("`tests/integration/test_train.py`, which requires one of these lines)")[1]
    assert lines[0] in quoted.split("```\n")[1].splitlines()
    # and the trainer's step numbers are detrace's step clock's (the validate section says so)
    assert f"first optimizer step (the trainer\nprints it as step {lines[0].split()[1]} too)" in doc


def test_fixed_dispatch_runs_are_bit_identical(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "3", "--dispatch", "fixed", "--threads", "2"]
    assert _steps(capsys, argv) == _steps(capsys, argv)


def test_deterministic_recipe_makes_index_dispatch_bit_identical(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "3", "--dispatch", "index", "--threads", "2", "--deterministic"]
    assert _steps(capsys, argv) == _steps(capsys, argv)


def test_exact_resume(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    argv = ["--steps", "4", "--dispatch", "fixed", "--recompute"]
    full = _steps(capsys, argv)
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("DETRACE_STOP_AT", "2")
    assert _steps(capsys, argv) == full[:2]
    monkeypatch.delenv("DETRACE_STOP_AT")
    monkeypatch.setenv("DETRACE_RESUME", "1")
    assert _steps(capsys, argv) == full[2:]
    # docs/workload.md quotes the steps the resumed run prints
    doc = " ".join((Path(__file__).parents[2] / "docs" / "workload.md").read_text().split())
    printed = [line.split()[1] for line in full[2:]]
    assert f"DETRACE_RESUME=1 python -m detrace.workload.train --steps 4` prints steps {' and '.join(printed)} " in doc


def test_bits_are_the_float32_encoding() -> None:
    assert bits(torch.tensor(1.0)) == "0x3f800000"
    assert bits(torch.tensor(-2.5)) == "0xc0200000"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--parallel", "ddp"], "--parallel ddp needs 2 or more processes"),
        (["--steps", "0"], "must be positive"),
        (["--lr", "-1"], "--lr must be positive"),
        (["--spike", "data"], "--spike and --spike-step go together"),
        (["--spike", "both", "--spike-step", "3", "--parallel", "tp"], "--spike both scales whole parameter rows"),
        (["--spike", "weights", "--spike-step", "3", "--parallel", "tp"], "--spike weights scales whole"),
        (["--spike", "moments", "--spike-step", "1"], "after S - 1 completed steps: --spike-step must"),
    ],
)
def test_errors_are_one_sentence(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("detrace.workload.train: error: ") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_config_rejects_unknown_preset() -> None:
    with pytest.raises(UsageError, match="preset"):
        TrainConfig(preset="huge")


def test_the_poisoned_samples_are_those_of_the_spike_step() -> None:
    from detrace.state import ResumableLoader, ResumableSampler
    from detrace.workload.train import _batch_samples

    sampler = ResumableSampler(40, seed=3)
    loader = ResumableLoader(list(range(40)), sampler=ResumableSampler(40, seed=3), batch_size=4, drop_last=True)
    fed = [batch.tolist() for _ in range(2) for batch in loader]  # two epochs of 10 batches
    assert [_batch_samples(sampler, 4, step) for step in (0, 7, 13)] == [fed[0], fed[7], fed[13]]
