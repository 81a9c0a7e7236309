"""`detrace audit` end to end: a real torchrun job of a nanoGPT-style script under DDP at 2 ranks, audited by the
CLI in a process of its own (the catalog, the judging, the probe and the report are checked in process in
tests/integration/test_audit.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PY = sys.executable


def _audit_cli(tmp_path: Path, *command: str) -> tuple[int, dict]:
    proc = subprocess.run([PY, "-m", "detrace", "audit", "--json", "--out", str(tmp_path / "run"), "--", *command],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_a_nanogpt_script_under_ddp_x2_shows_the_resume_parallel_and_data_hazards(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "support" / "scripts" / "audit_nanogpt.py"
    code, report = _audit_cli(tmp_path, PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script))
    # Seeded and with no racing op: nothing strikes in two runs from the start (exit 0); the bucket rebuild strikes
    # on a resume, a script that never builds a TrainState is told so.
    assert code == 0 and report["ranks"] == [0, 1] and report["certain"] == [] and report["steps"] == 2
    [rebuild] = [h for h in report["possible"] if "rebuilds its gradient buckets" in h["what"]]
    assert rebuild["subject"] == "DistributedDataParallel #0 (GPT)" and rebuild["ranks"] == [0, 1]
    possible = {(h["kind"], h["subject"]) for h in report["possible"]}
    assert {("parallel", "DistributedDataParallel #0 (GPT)"), ("data", "DataLoader #0 (Tokens)"),
            ("data", "DataLoader #0 (Tokens) sampler RandomSampler"),
            ("data", "collate_fn random_crop")} <= possible  # random_crop draws in the DataLoader's worker
