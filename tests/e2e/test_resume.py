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

MODES = "ddp,fsdp2"  # one after the other in the same 2 ranks, each on a model of its own


def test_distributed_resume_is_exact(tmp_path: Path) -> None:
    """2 ranks, 3 batches an epoch each: K=2 is mid-epoch, K=3 an epoch boundary; DDP and FSDP2 resume at each."""
    continuous = run(MODES, 5, tmp_path / "a", save_at=f"{tmp_path / 'ckpt' / '{mode}'}:2,3")
    for k in (2, 3):
        resumed = run(MODES, 5, tmp_path / f"b{k}", DETRACE_RESUME="1",
                      DETRACE_CKPT_DIR=str(tmp_path / "ckpt" / "{mode}" / f"k{k}"))
        for mode in MODES.split(","):
            assert_same_tail(continuous[mode], resumed[mode], k)
