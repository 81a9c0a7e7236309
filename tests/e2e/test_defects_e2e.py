"""Defect detection on the reference workload, in real processes: an injected bit flip (a test fault, named as
such) caught by the replica guard at dp-ep x4 and ddp x2, and `detrace recheck` finding a persistent flip on its
device. Recheck's other verdicts (transient, clean, and an inexact resume named instead of blaming the device), its
--checkpoint and its messages are judged in process on synthetic runs (tests/integration/test_defects.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow.compute as pc
import pytest

from detrace.cli import main as cli
from detrace.tracefile import read_rank

PY = sys.executable
pytestmark = pytest.mark.slow

TRAIN = ["-m", "detrace.workload.train", "--preset", "tiny", "--deterministic", "--threads", "1"]
NORM = "layers.0.norm.weight"  # replicated on every rank in ddp and dp-ep (not an expert)


Detrace = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def detrace(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Detrace:
    """detrace(ARGS, cwd, **env): `detrace ARGS` in this process, in `cwd`, with `env` added to the environment (CMD's
    processes, and the re-executions, are real), its exit code and output as a finished process's: one interpreter
    per command fewer than `python -m detrace`."""
    def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
        capfd.readouterr()
        with monkeypatch.context() as patch:
            patch.chdir(cwd)
            for key, value in env.items():
                patch.setenv(key, value)
            code = cli(args)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def torchrun(n: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


def guard_records(run: Path, rank: int) -> list[dict]:
    table = read_rank(run, rank).table
    return table.filter(pc.equal(table["name"], "guard")).select(["step", "value", "extra"]).to_pylist()


def test_guard_stops_dp_ep_before_the_next_checkpoint_and_outvotes_the_odd_rank(tmp_path: Path,
                                                                              detrace: Detrace) -> None:
    fault = f"bitflip:step=1,rank=1,tensor={NORM},bit=20"
    proc = detrace(["run", "--out", "run", "--guard", "1", "--", *torchrun(4), *TRAIN, "--steps", "3",
                    "--parallel", "dp-ep"], tmp_path, DETRACE_FAULT=fault,
                   DETRACE_CKPT_DIR=str(tmp_path / "ckpt"), DETRACE_STOP_AT="2")
    output = proc.stdout + proc.stderr  # detrace run passes CMD's output through
    assert proc.returncode != 0 and "exitcode  : 3" in output
    assert (f"detrace guard: step 1: the replicas of {NORM} differ after the optimizer step: rank 1 "
            "(outvoted by the other replicas, of 4 replicas)") in output
    assert not (tmp_path / "ckpt").exists()  # stopped before end_of_step(2) could save the corrupted state
    records = guard_records(tmp_path / "run", 0)
    assert [r["step"] for r in records] == [0, 1] and [r["value"] for r in records] == [0.0, 1.0]
    assert json.loads(records[1]["extra"])["mismatches"] == [{"tensor": NORM, "odd_ranks": [1]}]


def test_persistent_flip_on_a_ddp_rank_is_guarded_then_rechecked_to_its_device(tmp_path: Path,
                                                                             detrace: Detrace) -> None:
    fault = f"bitflip:step=2,rank=1,tensor={NORM},bit=20,repeat"
    proc = detrace(["run", "--out", "run", "--rung", "semantic", "--guard", "1:warn", "--", *torchrun(2), *TRAIN,
                    "--steps", "3", "--parallel", "ddp"], tmp_path, DETRACE_FAULT=fault)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (f"step 2: the replicas of {NORM} differ after the optimizer step: ranks 0, 1 (no majority"
            in proc.stdout + proc.stderr)
    proc = detrace(["recheck", "run", "--step", "2", "--out", "recheck", "--json"], tmp_path, DETRACE_FAULT=fault)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["verdict"] == "persistent" and result["ranks"] == [1]
    assert result["same_device"] == {"0": True, "1": True} and result["other_device"] == {"0": True, "1": False}
