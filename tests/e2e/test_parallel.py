"""Every parallel layout of the reference trainer with real processes on gloo, launched by torchrun.

Beyond "it trains", layouts that see the same data and the same weights must agree: DDP, FSDP2 and expert
parallelism compute the same first forward to the bit (FSDP gathers the same weights, EP runs the same rows
through the same experts on another rank), and the layouts that share one data stream (TP, PP) agree with
the single-process run to rounding.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from detrace.errors import UsageError
from detrace.workload.layouts import Layout, setup
from detrace.workload.model import PRESETS, HybridLM, ModelConfig
from detrace.workload.sharding import _pipeline_stage

TIMEOUT_S = 180


def _train(nproc: int, *args: str) -> list[dict[str, str]]:
    """Run the trainer (under torchrun when nproc > 1) for 2 steps; the fields of each step line."""
    train = ["-m", "detrace.workload.train", "--steps", "2", "--threads", "1", *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *launcher, *train], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = []
    for line in proc.stdout.splitlines():
        if line.startswith("step "):
            words = line.split()
            steps.append({"step": words[1], "loss_bits": words[4], "lm": words[6], "grad_norm": words[12]})
    assert [s["step"] for s in steps] == ["0", "1"], proc.stdout
    return steps


@functools.cache
def _reference(kind: str) -> list[dict[str, str]]:
    return _train(1) if kind == "none" else _train(2, "--parallel", kind)


@pytest.mark.slow
def test_ddp_two_ranks_trains() -> None:
    steps = _reference("ddp")
    assert steps[0]["loss_bits"] != steps[1]["loss_bits"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--parallel", "fsdp", "--recompute"], ["--parallel", "ep"]], ids=["fsdp", "ep"])
def test_data_parallel_layouts_match_ddp_bits_on_the_first_forward(args: list[str]) -> None:
    assert _train(2, *args)[0]["loss_bits"] == _reference("ddp")[0]["loss_bits"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--parallel", "tp"], ["--parallel", "pp", "--dispatch", "fixed"]], ids=["tp", "pp"])
def test_single_stream_layouts_match_the_single_process_run(args: list[str]) -> None:
    steps = _train(2, *args)
    assert float(steps[0]["lm"]) == pytest.approx(float(_reference("none")[0]["lm"]), rel=1e-5)


@pytest.mark.slow
def test_pipeline_times_data_parallel_at_world_four() -> None:
    steps = _train(4, "--parallel", "pp-dp")
    assert float(steps[0]["lm"]) == pytest.approx(float(_reference("ddp")[0]["lm"]), rel=1e-5)


@pytest.mark.slow
def test_data_times_expert_parallel_at_world_four() -> None:
    steps = _train(4, "--parallel", "dp-ep")
    assert all(float(s["grad_norm"]) > 0 for s in steps)


def test_pipeline_stage_keeps_layer_names() -> None:
    cfg = PRESETS["tiny"]["model"]
    assert isinstance(cfg, ModelConfig)
    first = _pipeline_stage(HybridLM(cfg), 0, 2)
    last = _pipeline_stage(HybridLM(cfg), 1, 2)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.embedding is not None and first.output is None and first.mtp is None
    assert last.embedding is None and last.output is not None
    assert "layers.1.moe" in dict(first.named_modules()) and "layers.2.attn" in dict(last.named_modules())


def test_layout_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match="torchrun"):
        setup("fsdp")
    with pytest.raises(UsageError, match="parallel layout"):
        setup("zero3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    with pytest.raises(UsageError, match="multiple of 4"):
        setup("pp-dp")
    assert setup("none") == Layout(kind="none", rank=0, world=1, device=setup("none").device)
