"""Rank-asymmetric training state (pipeline parallelism): each rank saves and is checked against its own
model/optimizer state, and a checkpoint that does not fit any one rank stops every rank with one sentence.

Real processes on gloo: two ranks holding different layers (torch.multiprocessing), and the reference
workload's `--parallel pp` under torchrun, resumed from a checkpoint of its continuous run and stopped, to the
same bits.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ranks import spawn_ranks

pytestmark = pytest.mark.slow


def _stage(rank: int, *, layout: str = "pipeline") -> torch.nn.Module:
    """Rank 0 holds the first layer, rank 1 the second, each under its name in the whole model.
    layout="swapped" gives each rank the other's layer; "renamed" renames rank 1's only."""
    torch.manual_seed(rank)
    first = (rank == 0) != (layout == "swapped")
    name = "embed" if first else ("head" if layout != "renamed" or rank != 1 else "output")
    return torch.nn.ModuleDict({name: torch.nn.Linear(4, 3 if first else 2)})


def _pipeline_ranks(rank: int, root: str, port: int) -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from detrace._exit import leave
    from detrace.errors import CheckpointError
    from detrace.state import TrainState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    report: dict[str, object] = {}

    def state(layout: str = "pipeline") -> TrainState:
        model = _stage(rank, layout=layout)
        return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))

    saved = state()
    for module in saved.model.values():
        module(torch.randn(5, 4)).square().sum().backward()
    saved.optimizer.step()
    saved.step = 1
    saved.save(root)

    # A fresh process's state: other values, an optimizer that has not stepped.
    steps: list[int] = []
    register_optimizer_step_post_hook(lambda *_: steps.append(1))
    resumed = state()
    with torch.no_grad():
        for parameter in resumed.model.parameters():
            parameter.add_(1.0)
    report["step"] = resumed.load(root)
    report["hooks"] = len(steps)
    report["params"] = all(map(torch.equal, saved.model.parameters(), resumed.model.parameters()))
    mine, theirs = saved.optimizer.state_dict(), resumed.optimizer.state_dict()
    report["moments"] = all(
        torch.equal(mine["state"][i][key], theirs["state"][i][key])
        for i in mine["state"] for key in ("exp_avg", "exp_avg_sq", "step")
    )
    for layout in ("renamed", "swapped"):
        try:
            state(layout).load(root)
        except CheckpointError as err:
            report[layout] = str(err)
    Path(root, f"report-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    leave(0)  # gloo's threads outlive the group: no interpreter finalization to race with


def test_each_rank_resumes_its_own_layers_and_a_misfit_on_one_rank_stops_all(tmp_path: Path) -> None:
    spawn_ranks(_pipeline_ranks, (str(tmp_path),), timeout=120)
    reports = [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["step"] == 1 and report["params"] and report["moments"]
        assert report["hooks"] == 0  # DCP's zero-lr initialising step is no training step
    # Each rank's file records its own layers; there is no state file common to all ranks.
    version = tmp_path / "step-00000001"
    assert not (version / "state.json").exists()
    skeletons = [json.loads((version / f"rank-{rank}.json").read_text())["shared"]["model"] for rank in range(2)]
    assert set(skeletons[0]) == {"embed.weight", "embed.bias"} and set(skeletons[1]) == {"head.weight", "head.bias"}
    # Only rank 1's layer was renamed: rank 1 names the tensor, rank 0 does not wait in DCP for it forever.
    assert re.search(r"holds tensor 'model\.head\.bias' that this training state \(rank 1 of 2\) does not have$",
                     reports[1]["renamed"])
    assert reports[0]["renamed"].endswith("does not fit the training state of another rank; see that rank's error")
    # Stages swapped: each rank finds the tensors of the stage it no longer is.
    assert "holds tensor 'model.embed.bias' that this training state (rank 0 of 2)" in reports[0]["swapped"]
    assert "holds tensor 'model.head.bias' that this training state (rank 1 of 2)" in reports[1]["swapped"]


def _train(tmp_path: Path, name: str, **env: str) -> list[str]:
    """The reference workload, 2 pipeline stages; the lines it printed for its steps."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "detrace.workload.train", "--parallel", "pp", "--threads", "1", "--steps", "4",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **env},
    )
    assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return [line for line in done.stdout.splitlines() if line.startswith("step ")]


def test_reference_pipeline_resumes_and_stops_with_the_same_bits(tmp_path: Path) -> None:
    """`--parallel pp`: stage 0 holds the embedding and the first layers, stage 1 the rest and the heads. Resumed
    in fresh processes from the checkpoint the continuous run saved after step 1, and stopped after step 3
    (DETRACE_STOP_AT, both stages), steps 2 and 3 print the continuous run's loss and gradient-norm bits."""
    ckpt = tmp_path / "ckpt"
    continuous = _train(tmp_path, "continuous", DETRACE_CKPT_DIR=str(ckpt), DETRACE_CKPT_EVERY="1")
    resumed = _train(tmp_path, "resumed", DETRACE_RESUME_FROM=str(ckpt / "step-00000001"),
                     DETRACE_CKPT_DIR=str(tmp_path / "stop"), DETRACE_STOP_AT="3")
    assert len(continuous) == 4
    assert resumed == continuous[1:3]
    assert (tmp_path / "stop" / "latest").read_text().strip() == "step-00000003"
