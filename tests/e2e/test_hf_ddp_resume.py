"""End to end: an HF `Trainer` script with `DetraceCallback` under torchrun, 2 ranks on gloo
(tests/support/scripts/hf_ddp.py, a GPT-2 with a BatchNorm). The resumed process loads its checkpoint (DCP's own
collectives) and HF gathers its logged loss across ranks; the continuous run evaluates (and saves) at the stop step,
where the resumed one starts; none of it is training, so `detrace check-resume` says `exact`, while its negative
control (a resume without the RNG states, under GPT-2's dropout) still diverges; each rank saved its own BatchNorm
statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parents[1] / "support" / "scripts" / "hf_ddp.py")


def test_hf_trainer_under_torchrun_resumes_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check-resume", "--at", "2", "--out", str(tmp_path / "check"), "--json", "--",
                 sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (0, "exact"), report
    point = report["points"][0]
    assert point["resume"]["verdict"] == "identical" and point["resume"]["compared"]["ranks"] == 2
    notes = point["resume"]["notes"]
    # the evaluations after steps 4 and 6, in both runs, bit-equal (a differing one would be a divergence); the one at
    # the stop step only in the continuous run
    assert any("compared apart from the training" in note and "; evaluations: " in note and
               "in both, every bit equal" in note.split("; evaluations: ")[1] for note in notes), notes
    assert point["control"]["verdict"] == "diverged"
    # before the first resumed update, every part of the restored state is the continuous run's, on both ranks
    restored = {c["part"]: c["equal"] for c in point["restored"]}
    assert restored == {"parameters": True, "optimizer state": True, "param groups": True, "scheduler": True,
                        "torch RNG state": True, "Python RNG state": True, "NumPy RNG state": True,
                        "data position": True}, point["restored"]
    # The model's BatchNorm statistics differ by rank (each rank's forward updates its own): each rank saved its own.
    manifest = next((tmp_path / "check" / "at-2" / "checkpoint").glob("checkpoint-2/detrace/step-*/manifest.json"))
    tensors = json.loads(manifest.read_text())["tensors"]
    assert {f"rank{rank}/model.transformer.h.0.mlp.act.0.running_mean" for rank in (0, 1)} <= set(tensors)
