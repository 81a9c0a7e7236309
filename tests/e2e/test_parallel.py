"""Every parallel layout of the reference trainer with real processes on gloo, launched by torchrun.

Beyond "it trains", layouts that see the same data and the same weights must agree: DDP, FSDP2 and expert
parallelism compute the same first forward to the bit (FSDP gathers the same weights, EP runs the same rows
through the same experts on another rank), and the layouts that share one data stream (TP, PP) agree with
the single-process run to rounding. The layouts of one world size run one after the other in the processes of
one torchrun job (tests/support/scripts/layouts.py): a launcher and its interpreters are paid once per world size.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from detrace.errors import UsageError
from detrace.workload.layouts import Layout, setup
from detrace.workload.model import PRESETS, HybridLM, ModelConfig
from detrace.workload.pipeline_parallel import _pipeline_stage

TIMEOUT_S = 600
LAYOUTS = Path(__file__).parents[1] / "support" / "scripts" / "layouts.py"


def _train(nproc: int, *layouts: str) -> dict[str, list[dict[str, str]]]:
    """Run the trainer for 2 steps at each layout (its arguments), in the processes of one torchrun job of
    `nproc` ranks; the fields of each step line, by layout."""
    runs = [f"--steps 2 --threads 1 {layout}" for layout in layouts]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(LAYOUTS), *runs],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps: dict[str, list[dict[str, str]]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("layout "):
            current = steps.setdefault(line.removeprefix("layout --steps 2 --threads 1 "), [])
        elif line.startswith("step "):
            words = line.split()
            current.append({"step": words[1], "loss_bits": words[4], "lm": words[6], "grad_norm": words[12]})
    assert list(steps) == list(layouts), proc.stdout
    for layout, found in steps.items():
        assert [s["step"] for s in found] == ["0", "1"], (layout, proc.stdout)
    return steps


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[dict[str, str]]]:
    """The single-process run and every 2-rank layout, in one torchrun job of 2 ranks."""
    return _train(2, "--parallel none", "--parallel ddp", "--parallel fsdp --recompute", "--parallel ep",
                  "--parallel tp", "--parallel pp --dispatch fixed")


@pytest.mark.slow
def test_two_rank_layouts_train_and_agree_with_ddp_or_the_single_process_run(
        two_ranks: dict[str, list[dict[str, str]]]) -> None:
    ddp, single = two_ranks["--parallel ddp"], two_ranks["--parallel none"]
    assert ddp[0]["loss_bits"] != ddp[1]["loss_bits"]  # DDP trains
    # the layouts that see the same data and weights compute DDP's first forward to the bit
    for layout in ("--parallel fsdp --recompute", "--parallel ep"):
        assert two_ranks[layout][0]["loss_bits"] == ddp[0]["loss_bits"], layout
    # the layouts that share one data stream agree with the single-process run to rounding
    for layout in ("--parallel tp", "--parallel pp --dispatch fixed"):
        assert float(two_ranks[layout][0]["lm"]) == pytest.approx(float(single[0]["lm"]), rel=1e-5), layout


@pytest.mark.slow
def test_layouts_at_world_four_train_and_pipeline_times_data_parallel_matches_ddp(
        two_ranks: dict[str, list[dict[str, str]]]) -> None:
    four = _train(4, "--parallel pp-dp", "--parallel dp-ep")
    assert float(four["--parallel pp-dp"][0]["lm"]) == pytest.approx(float(two_ranks["--parallel ddp"][0]["lm"]),
                                                                     rel=1e-5)
    assert all(float(s["grad_norm"]) > 0 for s in four["--parallel dp-ep"])


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
