"""Exact resume, end to end, in real processes: a run of 2 ranks stopped at step K and resumed in fresh processes
continues with exactly the bits (losses and final parameters) of the run that never stopped, as DDP and as FSDP2
(gloo). The workload (tests/support/_resume_program.py) has every source of randomness a resume can get wrong:
dropout, a shuffling sampler with two DataLoader workers doing random augmentation (torch, NumPy and Python RNGs),
an LR scheduler and AdamW. One process, its stop/resume contract and the negative control are checked in
tests/integration/test_resume_single.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _resume_program import assert_same_tail, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("mode", "k"), [("ddp", 2), ("fsdp2", 3)])
def test_distributed_resume_is_exact(tmp_path: Path, mode: str, k: int) -> None:
    """2 ranks, 3 batches an epoch each: K=2 is mid-epoch (DDP), K=3 an epoch boundary (FSDP2). Where the sampler
    and the loader stand does not depend on the mode (tests/integration/test_state.py resumes them anywhere), what
    is sharded does not depend on K: one K a mode."""
    continuous = run(mode, 5, tmp_path / "a", save_at=f"{tmp_path / 'ckpt'}:{k}")
    resumed = run(mode, 5, tmp_path / "b", DETRACE_RESUME="1", DETRACE_CKPT_DIR=str(tmp_path / f"ckpt/k{k}"))
    assert_same_tail(continuous, resumed, k)
