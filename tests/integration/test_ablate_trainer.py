"""`detrace spikes` and `detrace ablate` on the reference trainer's planted spikes, in process: each kind (data,
state, both) is found, replayed bit for bit from the trainer's own checkpoints, and told apart by the trainer's
real losses under ablate's data controls.

The launcher runs the trainer in this process (its real losses, checkpoints, resume and data controls) and writes
the losses it printed as a metrics trace through the real writer: a run of 13 steps takes about a second of CPU
here, a traced process (torch imported, the tracer on) several. Real traced processes: ablate's refusal of a run
that does not reproduce (tests/e2e/test_ablate_e2e.py), a baseline and a variant through HF's callback
(tests/e2e/test_integrations_hf.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from _environment import contract_environment
from _synthetic import write_metric_run

from detrace.cli import main as detrace
from detrace.investigate.ablate import AblateConfig, ablate
from detrace.workload.train import main as train

S = 12
TRAINER = ("detrace.workload.train", "--preset", "tiny", "--threads", "1", "--deterministic")


def trainer_launch(cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
    """An ablate launcher (`detrace.investigate.ablate.Launch`): the trainer's run of `cmd[1:]` under `env`, its
    printed losses (exact float32 bits) recorded as the loss metric of run directory `out`."""
    began = time.perf_counter()
    printed = io.StringIO()
    with contract_environment(env), contextlib.redirect_stdout(printed):
        assert train(list(cmd[1:])) == 0
    losses: dict[int, float] = {}
    for line in printed.getvalue().splitlines():
        if line.startswith("step "):  # step 12 loss 8.882612 (0x410e1f2e) lm ...
            fields = line.split()
            losses[int(fields[1])] = struct.unpack(">f", bytes.fromhex(fields[4][3:-1]))[0]
    start = min(losses)
    write_metric_run(out, {t: losses.get(t, 0.0) for t in range(max(losses) + 1)}, first=start)
    return time.perf_counter() - began


def original(tmp_path: Path, kind: str, s: int = S) -> Path:
    """The original run of the planted spike, with a checkpoint every 4 steps, run.json naming their directory."""
    run, ckpts = tmp_path / "original", tmp_path / "ckpt"
    cmd = (*TRAINER, "--steps", str(s + 1), "--spike", kind, "--spike-step", str(s))
    trainer_launch(cmd, run, {"DETRACE_CKPT_DIR": str(ckpts), "DETRACE_CKPT_EVERY": "4"})
    (run / "run.json").write_text(json.dumps({"rung": "metrics", "checkpoint_dir": str(ckpts)}))
    return run


@pytest.mark.parametrize("kind", ["data", "state", "both"])
def test_each_planted_spike_is_found_reproduced_and_told_apart(kind: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = original(tmp_path, kind)
    assert detrace(["spikes", str(run), "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["checkpoint"]) for s in found["spikes"]] == [(S, 8)]  # the planted step alone
    cmd = (*TRAINER, "--steps", str(S + 1), "--spike", kind, "--spike-step", str(S))
    result = ablate(AblateConfig(command=cmd, run=run, step=S, after=0, out=tmp_path / "ablate"), trainer_launch)
    assert result.verdict == "isolated" and result.cause == kind, result.summary
    assert result.checkpoint == 8 and result.baseline is not None
    assert result.baseline.value == result.original[S]  # the replay from step 8 reproduced the spike bit for bit
    spiked = {o.variant.name: o.spiked for o in result.outcomes}
    assert spiked == {"data-from-earlier": kind == "data", "skip-batches": kind == "state",
                      "state-only": kind == "state"}, result.summary
    if kind != "state":
        assert result.split is None
        return
    # The planted state spike is a schedule fault: the scheduler's step count at C decides the bumped step. With
    # the learning rate of the checkpoint after 4 steps (the rest from 8) the bump comes after S; with the earlier
    # weights or moments it does not move.
    assert result.split is not None and result.split.earlier == 4
    assert {o.variant.name: o.spiked for o in result.split.replays} == {
        "restore-lr": False, "restore-moments": True, "restore-weights": True}
    # The trace is the loss alone: the earlier weights change the loss of step 8, the others the update after it.
    assert {o.variant.name: o.departure and o.departure.step for o in result.split.replays} == {
        "restore-lr": 9, "restore-moments": 9, "restore-weights": 8}
    assert result.split.parts == ("lr",) and "the state's part that carries it: lr" in result.summary
    assert len(result.runs) == 7


@pytest.mark.parametrize("kind", ["moments", "weights"])
def test_the_part_of_the_state_that_carries_a_planted_fault_is_named(kind: str, tmp_path: Path) -> None:
    # The fault is planted after 8 completed steps, before the save there: the checkpoint after 8 steps carries it,
    # the one after 4 does not (the learning rate's planted fault is the state spike above).
    s = 9
    run = original(tmp_path, kind, s)
    cmd = (*TRAINER, "--steps", str(s + 1), "--spike", kind, "--spike-step", str(s))
    result = ablate(AblateConfig(command=cmd, run=run, step=s, after=0, out=tmp_path / "ablate"), trainer_launch)
    assert result.cause == "state" and result.checkpoint == 8, result.summary
    assert result.split is not None and result.split.earlier == 4
    assert {o.variant.name: o.spiked for o in result.split.replays} == {
        "restore-lr": True, "restore-moments": kind != "moments", "restore-weights": kind != "weights"}
    assert all(o.departure is not None for o in result.split.replays)
    assert result.split.parts == (kind,) and f"the state's part that carries it: {kind}" in result.summary
