"""`detrace spikes` and `detrace ablate` end to end: the reference trainer's planted data spike (found, replayed bit
for bit in fresh processes, and isolated) and the refusal of a run that does not reproduce. A framework's run through
its callback: tests/e2e/test_integrations_hf.py (real processes), tests/integration/test_lightning.py (the variant's
data shift, in process). Every kind's verdict on the trainer's real losses is checked in process
(tests/integration/test_ablate_trainer.py), the decision logic on synthetic traces (tests/unit/test_ablate.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

S = 12
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def trainer(*extra: str) -> list[str]:
    return [sys.executable, "-m", "detrace.workload.train", "--preset", "tiny", "--threads", "1", *extra]


def traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: list[str], *, every: int) -> Path:
    """The original run, traced at the metrics rung, with a checkpoint every `every` steps (run.json names them)."""
    run = tmp_path / "original"
    with monkeypatch.context() as env:
        env.setenv("DETRACE_CKPT_DIR", str(tmp_path / "ckpt"))
        env.setenv("DETRACE_CKPT_EVERY", str(every))
        assert main(["run", "--out", str(run), "--", *cmd]) == 0
    return run


def json_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_a_planted_data_spike_is_found_replayed_and_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    kind = "data"  # the batch of step S is poisoned: its replay from an earlier state spikes too
    cmd = trainer("--deterministic", "--steps", str(S + 1), "--spike", kind, "--spike-step", str(S))
    run = traced(tmp_path, monkeypatch, cmd, every=4)
    code, found = json_of(["spikes", str(run), "--json"], capsys)
    assert code == 1 and found["spikes"][0]["step"] == S and found["spikes"][0]["checkpoint"] == 8
    assert [s["step"] for s in found["spikes"]] == [S]
    code, result = json_of(["ablate", "--step", str(S), "--run", str(run), "--after", "0", "--out",
                            str(tmp_path / "ablate"), "--json", "--", *cmd], capsys)
    assert code == 1 and result["verdict"] == "isolated", result
    assert result["cause"] == kind, result["summary"]
    assert result["baseline"]["value"] == result["original"]  # the replay reproduced the spike bit for bit
    spiked = {v["name"]: v["spiked"] for v in result["variants"]}
    assert spiked["data-from-earlier"] is (kind == "data")
    assert spiked["skip-batches"] is (kind == "state")
    assert result["cost"]["runs"] == 4 and (tmp_path / "ablate" / "report.html").is_file()


def test_a_run_that_does_not_reproduce_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # An injected fault, named as such, makes the replay part from the original: one bit of a norm weight flips
    # as the replay's optimizer step 9 begins (the original never met it). A real race is no fit here: a race
    # that perturbs the parameters by an ulp can leave the losses' float32 bits as they were for steps on end.
    cmd = trainer("--deterministic", "--steps", "12")
    run = traced(tmp_path, monkeypatch, cmd, every=4)
    code, found = json_of(["spikes", str(run), "--json"], capsys)
    assert (code, found["verdict"], found["spikes"]) == (0, "clean", [])  # nothing but the planted steps, ever
    capsys.readouterr()
    monkeypatch.setenv("DETRACE_FAULT", "bitflip:step=9,rank=0,tensor=layers.0.norm.weight,bit=20")
    code = main(["ablate", "--step", "11", "--run", str(run), "--after", "0", "--out", str(tmp_path / "a"), "--",
                 *cmd])
    out = capsys.readouterr().out
    assert code == 2 and out.startswith("not-reproducible: not reproducible: the replay from the checkpoint "
                                        "after 8 steps differs from the original run (rank 0, step "), out
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.is_dir()) == ["baseline", "checkpoints"]
