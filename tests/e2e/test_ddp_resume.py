"""DDP exact resume at 4 ranks on gloo: a plain DDP loop with TrainState (bucket_cap_mb=0.1, no
find_unused_parameters), saved after step 3 and resumed from there in fresh processes, ends with the continuous
run's parameters, because TrainState pins one bucket layout for the whole run. Without the pin (the arm
"unpinned", the old behaviour) it does not: the resumed processes run step 4 on DDP's initial layout
(tests/support/scripts/ddp_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import detrace

SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "ddp_resume.py"


def _torchrun(env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(SCRIPT)], env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _continuous_and_resumed(tmp_path: Path) -> dict[tuple[str, bool], set[str]]:
    """The final parameters of a run that saved after step 3 and went on to step 6, and of one resumed from
    that checkpoint in fresh processes, by arm (unpinned, pinned) and whether it was resumed (one digest per
    rank). Each job runs both arms, one after the other, each on a DDP module of its own."""
    report = tmp_path / "report.jsonl"
    common = {"REPORT": str(report), "STEPS": "6", "ARMS": "unpinned,pinned"}
    _torchrun({**common, "DETRACE_CKPT_DIR": str(tmp_path / "a" / "{arm}"), "DETRACE_CKPT_EVERY": "3"})
    _torchrun({**common, "DETRACE_CKPT_DIR": str(tmp_path / "b" / "{arm}"),
               "DETRACE_RESUME_FROM": str(tmp_path / "a" / "{arm}" / "step-00000003")})
    found: dict[tuple[str, bool], set[str]] = {}
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted((row["arm"], row["resumed"], row["rank"]) for row in rows) == sorted(
        (arm, resumed, rank) for arm in ("pinned", "unpinned") for resumed in (False, True) for rank in range(4))
    for row in rows:
        found.setdefault((row["arm"], row["resumed"]), set()).add(row["params"])
    return found


def _buckets(ddp: DDP) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


@pytest.mark.parametrize("wrapped_after", [False, True])
def test_train_state_pins_the_layout_before_the_first_backward(one_rank: None, wrapped_after: bool) -> None:
    """Given the DDP module, or the module a DDP made later wraps (accelerate's unwrap_model, HF's model), the
    TrainState has DDP rebuild its buckets at its first forward, in every process alike, not after its first
    backward; and the global hook that finds the wrapper is gone once it has."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    hooks = len(torch.nn.modules.module._global_forward_pre_hooks)
    if wrapped_after:
        detrace.TrainState(model=inner)
        ddp = DDP(inner, bucket_cap_mb=0.01)
    else:
        ddp = DDP(inner, bucket_cap_mb=0.01)
        detrace.TrainState(model=ddp)
    assert _buckets(ddp) == 1  # DDP starts with every parameter in one bucket
    ddp(torch.ones(2, 64)).sum().backward()
    assert _buckets(ddp) > 1  # rebuilt before that backward, into buckets of the cap
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == hooks


def test_without_the_pin_ddp_rebuilds_after_the_first_backward(one_rank: None) -> None:
    """What the pin changes: the layout of a process's first step is otherwise not that of its later steps."""
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01)
    ddp(torch.ones(2, 64)).sum().backward()
    assert _buckets(ddp) == 1
    ddp(torch.ones(2, 64)).sum().backward()
    assert _buckets(ddp) > 1


@pytest.mark.slow
def test_ddp_resume_is_exact_only_with_one_bucket_layout(tmp_path: Path) -> None:
    found = _continuous_and_resumed(tmp_path)
    assert all(len(digests) == 1 for digests in found.values())  # every rank agrees within a run
    assert found["unpinned", True] != found["unpinned", False], (
        "DDP's bucket rebuild no longer changes a resumed run's bits")
    assert found["pinned", True] == found["pinned", False]
