"""`detrace spikes` and `detrace ablate` end to end on the reference trainer: a run that does not reproduce, refused
(docs/ablate.md quotes it). Each planted kind (data, state, both) found, replayed bit for bit from the trainer's
checkpoints and told apart, on the trainer's real losses: in process (tests/integration/test_ablate_trainer.py);
ablate's baseline and a variant in real processes, through a framework's callback: tests/e2e/test_integrations_hf.py;
the decision logic on synthetic traces (tests/unit/test_ablate.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow


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
