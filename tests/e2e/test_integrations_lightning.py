"""DetraceCallback on a real Lightning Trainer under DDP: examples/lightning_train.py (an MLP with a BatchNorm, whose
running statistics differ by rank, and dropout, a random augmentation in the dataset, gradient accumulation, an LR
scheduler, `self.log(..., sync_dist=True)`, a validation loop right after the stop step) as 2 processes
started by torchrun on gloo, with the DistributedSampler Lightning installs. `detrace check-resume` proves the
callback's resume exact. The one-process runs, the callback's logic and the same script without the callback (resumed by
Lightning's own `ckpt_path`, which changes the run) are checked in process (tests/integration/test_lightning.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_train.py"
AT = 3  # 24 samples, 4 per batch per rank: 3 batches (2 steps) per epoch; step 3 is epoch 1's second, after 2 batches


def _torchrun(report: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--devices", "2", "--steps", "4", "--report", str(report),
            "--val-every", "5"]  # a validation loop after the 5th batch: right after step 3, the stop step


def _finals(report: Path) -> dict[tuple[str, int], set[str]]:
    """(kind of run, rank) -> the final parameters that rank ended with."""
    found: dict[tuple[str, int], set[str]] = {}
    for line in report.read_text().splitlines():
        run = json.loads(line)
        kind = ("control" if run["DETRACE_RESUME_CONTROL"] else "resumed" if run["DETRACE_RESUME"] == "1"
                else "stopped" if run["DETRACE_STOP_AT"] else "continuous")
        found.setdefault((kind, run["rank"]), set()).add(run["params"])
    return found


def test_ddp_resume_is_exact_with_the_callback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.jsonl"
    code = main(["check-resume", "--at", str(AT), "--out", str(tmp_path / "check"), "--json", "--",
                 *_torchrun(report)])
    payload = json.loads(capsys.readouterr().out)
    assert (code, payload["verdict"]) == (0, "exact"), payload
    point = payload["points"][0]
    assert point["resume"]["verdict"] == "identical" and point["resume"]["compared"]["ranks"] == 2
    # the resumed processes' checkpoint load and Lightning's logging all-reduce are not the training; nor is the
    # validation loop the continuous run made right after the stop step (in the step before the compared ones), which
    # made this verdict `resume-changed-the-run` while it moved the step clock and drew from the RNGs
    assert any("compared apart from the training" in note for note in point["resume"]["notes"]), point["resume"]
    assert point["control"]["verdict"] == "diverged"
    finals = _finals(report)
    for rank in (0, 1):  # bit-equal final parameters on every rank, and the negative control elsewhere
        assert len(finals["continuous", rank]) == 1 and finals["resumed", rank] == finals["continuous", rank]
        assert finals["control", rank].isdisjoint(finals["continuous", rank])
    # Every rank wrote its part of detrace's state beside the file Lightning wrote on rank 0.
    ckpt = tmp_path / "check" / f"at-{AT}" / "checkpoint" / f"step-{AT:08d}.ckpt"
    written = {path.name for path in Path(f"{ckpt}.detrace").glob("step-*/rank-*.json")}
    assert ckpt.is_file() and written == {"rank-0.json", "rank-1.json"}
    # The model's BatchNorm statistics differ by rank (each rank's forward updates its own): each rank saved its own.
    manifest = next(Path(f"{ckpt}.detrace").glob("step-*/manifest.json"))
    tensors = json.loads(manifest.read_text())["tensors"]
    assert {f"rank{rank}/model.net.1.running_mean" for rank in (0, 1)} <= set(tensors)

