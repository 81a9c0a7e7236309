"""Defect detection, in one process: the fault spec and the bit flip, the guard's vote, recheck's verdicts and
their error paths. The multi-process cases (DDP, dp-ep) are in test_defects_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _synthetic import Fault, SyntheticRun, TrainingStep, write_run, write_training_rank
from torch import nn

from detrace.defects.arming import arm_from_env
from detrace.defects.faults import ENV_DEVICE_SHIFT, FaultInjector, FaultSpec, flip_bit, global_step
from detrace.defects.guard import Guard, Mismatch, _digests, parse_env, vote
from detrace.defects.recheck import judge, recheck, step_results
from detrace.errors import UsageError
from detrace.launch.launcher import LaunchResult
from detrace.state import TrainState
from detrace.tracefile.layout import run_header_path
from detrace.tracefile.writer import write_json_atomic
from detrace.verdicts import RECHECK

PY = sys.executable


def test_fault_spec_parses_every_key() -> None:
    spec = FaultSpec.parse("bitflip:step=3,rank=1,tensor=layers.0.norm.weight,bit=20,index=5,repeat")
    assert spec == FaultSpec(step=3, rank=1, tensor="layers.0.norm.weight", bit=20, index=5, repeat=True)
    assert FaultSpec.parse("bitflip:step=0,rank=0,tensor=w.grad,bit=0").repeat is False


@pytest.mark.parametrize("text, words", [
    ("flip:step=1,rank=0,tensor=w,bit=1", "is not a fault"),
    ("bitflip:step=1,rank=0,tensor=w", "lacks bit"),
    ("bitflip:step=x,rank=0,tensor=w,bit=1", "step must be a non-negative integer"),
    ("bitflip:step=1,rank=0,tensor=w,bit=1,speed=3", "unknown key 'speed'"),
    ("bitflip:step=1,rank=0,tensor=w,bit=1,repeat=yes", "repeat takes no value"),
    ("bitflip:step=1,rank=0,tensor=,bit=1", "needs tensor=NAME"),
    ("bitflip:step=1,rank=0,tensor=w,bit=999", "bit 999 is outside every element"),
])
def test_fault_spec_refuses_malformed_text(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        FaultSpec.parse(text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_flip_bit_changes_exactly_one_bit(dtype: torch.dtype) -> None:
    t = torch.arange(6).to(dtype)
    before = t.clone()
    flip_bit(t, index=4, bit=3)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    changed = (t.view(width) ^ before.view(width)).tolist()
    assert changed == [0, 0, 0, 0, 8, 0]
    flip_bit(t, index=4, bit=3)
    assert torch.equal(t.view(width), before.view(width))  # a flip undoes itself


def test_flip_bit_reaches_the_sign_bit_and_refuses_outside_the_tensor() -> None:
    t = torch.ones(2)
    flip_bit(t, index=1, bit=31)
    assert t.tolist() == [1.0, -1.0]
    with pytest.raises(UsageError, match="index 2 is outside"):
        flip_bit(t, index=2, bit=0)
    with pytest.raises(UsageError, match="bit 32 is outside"):
        flip_bit(t, index=0, bit=32)


def _train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        model(torch.ones(2, 4)).square().sum().backward()  # the loss reads the output's bits
        optimizer.step()
        optimizer.zero_grad()
        seen.append(model.weight.detach().clone())
    return seen


@pytest.mark.parametrize("tensor", ["weight", "weight.grad", "output"])
def test_injected_fault_strikes_once_at_its_step(tensor: str) -> None:
    torch.manual_seed(0)
    clean = _train(nn.Linear(4, 3), 3)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    bystander = nn.Sequential(nn.Linear(4, 4))  # another live root module: `output` is the outermost *call*'s
    injector = FaultInjector(FaultSpec(step=1, rank=0, tensor=tensor, bit=22))
    injector.install()
    try:
        faulty = _train(model, 3)
    finally:
        injector.remove()
    assert torch.equal(faulty[0], clean[0]) and not torch.equal(faulty[1], clean[1])
    assert injector.struck == [1] and bystander[0].weight.grad is None


def test_a_flip_that_does_not_fit_its_tensor_is_said_once_and_the_training_runs_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    for spec in (FaultSpec(step=0, rank=0, tensor="weight", bit=40, repeat=True),  # float32: 32 bits
                 FaultSpec(step=0, rank=0, tensor="weight", bit=3, index=99, repeat=True)):  # 12 elements
        injector = FaultInjector(spec)
        injector.install()
        try:
            _train(nn.Linear(4, 3), 3)
        finally:
            injector.remove()
        err = capsys.readouterr().err
        assert injector.struck == [] and err.count("\n") == 1 and "it can never strike" in err
        assert "is outside" in err


def test_a_malformed_fault_is_one_sentence_and_the_program_runs_on(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DETRACE_FAULT", "bitflip:step=0,rank=0,tensor=weight,bit=999")
    arm_from_env()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bit 999 is outside every element" in err and "the injected fault is off" in err
    _train(nn.Linear(4, 3), 2)


def test_a_malformed_fault_is_said_once_however_often_it_is_armed(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """#49.12: under `detrace run`, the tracer's start and the script's TrainState both arm: the sentence was printed
    twice."""
    monkeypatch.setenv("DETRACE_FAULT", "bitflip:step=once,rank=0,tensor=w,bit=1")
    arm_from_env()
    TrainState(model=nn.Linear(2, 2))  # arms again, as in a traced script
    arm_from_env()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step must be a non-negative integer, not 'once'" in err

def test_repeat_fault_follows_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = FaultSpec(step=0, rank=1, tensor="weight", bit=22, repeat=True)
    for device, strikes in (("1", [0, 1, 2]), ("0", [])):
        monkeypatch.setenv("DETRACE_DEVICE_ID", device)
        injector = FaultInjector(spec)
        injector.install()
        try:
            _train(nn.Linear(4, 3), 3)
        finally:
            injector.remove()
        assert injector.struck == strikes


def test_transient_fault_spares_a_reexecution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_REEXEC", "1")
    injector = FaultInjector(FaultSpec(step=0, rank=0, tensor="weight", bit=22))
    injector.install()
    try:
        _train(nn.Linear(4, 3), 2)
    finally:
        injector.remove()
    assert injector.struck == []


def test_global_step_counts_on_from_a_restored_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    adam = torch.optim.Adam(model.parameters())
    assert global_step(adam, 0) == 0
    model(torch.ones(1, 2)).sum().backward()
    adam.step()
    restored = torch.optim.Adam(model.parameters())
    restored.load_state_dict(adam.state_dict())
    assert global_step(restored, 0) == 1  # one step already taken before this process began
    monkeypatch.setenv("DETRACE_STEP_OFFSET", "40")
    assert global_step(torch.optim.SGD(model.parameters(), lr=0.1), 2) == 42


def test_vote_names_the_outvoted_replica_or_both_of_two() -> None:
    keys = [[1, 2], [1, 2], [1, 2]]
    digests = [[10, 20], [10, 21], [10, 20]]
    assert vote(keys, digests, {1: "a", 2: "b"}, step=4) == [
        Mismatch(step=4, tensor="b", odd_ranks=(1,), replicas=(0, 1, 2))]
    two = vote([[7], [7]], [[1], [2]], {7: "w"}, step=0)
    assert two[0].odd_ranks == (0, 1) and "no majority" in two[0].sentence()
    # Shards are only compared with their replicas: a key held by one rank alone is nobody's replica.
    assert vote([[1, 3], [1, 4]], [[5, 6], [5, 7]], {}, step=0) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_guard_digest_sees_every_bit_shape_and_order_not_strides(dtype: torch.dtype) -> None:
    base = (torch.arange(3000) % 7).to(dtype)
    [digest] = _digests([base])
    assert _digests([base.clone()]) == [digest]
    for bit in (0, 5, 8 * base.element_size() - 1):
        flipped = base.clone()
        flip_bit(flipped, index=1234, bit=bit)
        assert _digests([flipped]) != [digest], bit
    swapped = base.clone()
    swapped[[10, 11]] = base[[11, 10]]
    assert _digests([swapped]) != [digest]
    grid = base.reshape(60, 50)
    assert _digests([grid.t().contiguous().t()]) == _digests([grid]) != [digest]


def test_guard_options_are_checked() -> None:
    assert parse_env("5") == (5, "stop") and parse_env("2:warn") == (2, "warn")
    for bad in ("0", "x", "3:loud", "-1"):
        with pytest.raises(UsageError, match="DETRACE_GUARD"):
            parse_env(bad)
    with pytest.raises(UsageError, match="positive integer"):
        Guard(every=0, mode="stop")
    with pytest.raises(UsageError, match="'stop' or 'warn'"):
        Guard(every=1, mode="loud")  # type: ignore[arg-type]


def test_run_refuses_a_bad_guard_before_starting_the_command(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from detrace.cli import main as cli

    marker = tmp_path / "ran"
    assert cli(["run", "--out", str(tmp_path / "r"), "--guard", "often", "--",
                PY, "-c", f"open({str(marker)!r}, 'w')"]) == 2
    err = capsys.readouterr().err
    assert "DETRACE_GUARD='often'" in err and "Traceback" not in err and err.count("\n") == 1
    assert not marker.exists()


def test_judge_tells_the_four_verdicts() -> None:
    run = {0: {("w", "param", 0, 0): 1}, 1: {("w", "param", 0, 0): 2}}
    flipped = {0: {("w", "param", 0, 0): 1}, 1: {("w", "param", 0, 0): 1}}
    assert judge(run, run, run) == ("clean", ())
    assert judge(run, run, flipped) == ("persistent", (1,))
    assert judge(run, flipped, flipped) == ("transient", (1,))
    noisy = {0: {("w", "param", 0, 0): 3}, 1: {("w", "param", 0, 0): 4}}
    assert judge(run, noisy, flipped) == ("software-nondeterminism", (0, 1))
    assert judge(run, noisy, noisy) == ("software-nondeterminism", (0, 1))  # no rank reproduced at all


def test_recheck_error_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Exception, match="does not exist"):
        recheck(tmp_path / "missing", step=1, out=tmp_path / "out")
    from detrace.cli import main as cli

    assert cli(["recheck", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "--step" in err and "Traceback" not in err


RUN = SyntheticRun(ranks=1, steps=3, ops=2)
FLIP = Fault(rank=0, step=2, op=0)
"""An injected fault, named as such: it gives step 2 other bits."""


def _fake_launcher(faults: dict[str, Fault | None], launched: list[str]):  # type: ignore[no-untyped-def]
    """Stands in for run_traced: writes the synthetic trace each kind of run would record ("prepare", "same",
    "other", "uninterrupted": the run directory's name), with the fault given for it."""
    def launch(command, directory, *, rung, steps, env, timeout, quiet):  # type: ignore[no-untyped-def]
        directory = Path(directory)
        launched.append(directory.name)
        assert env.get(ENV_DEVICE_SHIFT, "0") == ("1" if directory.name == "other" else "0")
        Path(env["DETRACE_CKPT_DIR"]).mkdir(parents=True, exist_ok=True)
        write_run(directory, RUN, faults.get(directory.name))
        return LaunchResult(returncode=0, out=directory, command=tuple(command), elapsed=0.0, output_tail="")
    return launch


def _original(tmp_path: Path, fault: Fault | None) -> Path:
    run = tmp_path / "run"
    write_run(run, RUN, fault)
    write_json_atomic(run_header_path(run), {"command": ["python", "train.py"], "world_size": 1})
    return run


def test_recheck_calls_an_inexact_resume_by_its_name_not_a_transient_fault(tmp_path: Path) -> None:
    # The re-executions resume from the checkpoint and agree with each other, but an uninterrupted run gives the
    # original's bits: the checkpoint misses some state. Before the resume proof this was "transient".
    launched: list[str] = []
    result = recheck(_original(tmp_path, None), step=2, out=tmp_path / "out",
                     launch=_fake_launcher({"same": FLIP, "other": FLIP}, launched))
    assert launched == ["prepare", "same", "other", "uninterrupted"]
    assert result.verdict == "inexact-resume" and result.resume_exact is False
    assert "inexact resume" in result.sentence() and "check-resume" in result.sentence()
    assert RECHECK["inexact-resume"] == 2


def test_recheck_blames_a_transient_fault_only_after_the_resume_is_proven(tmp_path: Path) -> None:
    launched: list[str] = []
    result = recheck(_original(tmp_path, FLIP), step=2, out=tmp_path / "out", launch=_fake_launcher({}, launched))
    assert launched == ["prepare", "same", "other", "uninterrupted"]
    assert result.verdict == "transient" and result.resume_exact is True
    assert result.sentence().startswith("transient: rank 0 does not reproduce its own result of step 2")
    assert RECHECK["transient"] == 1


def test_recheck_calls_a_step_reproduced_everywhere_clean(tmp_path: Path) -> None:
    launched: list[str] = []
    result = recheck(_original(tmp_path, None), step=2, out=tmp_path / "out", launch=_fake_launcher({}, launched))
    assert launched == ["prepare", "same", "other"]
    assert result.verdict == "clean" and RECHECK["clean"] == 0
    assert result.sentence().startswith("clean: step 2 re-executed on the same and on other devices gives the "
                                        "run's bits")


def test_recheck_from_a_given_checkpoint_makes_none_and_refuses_one_past_the_step(tmp_path: Path) -> None:
    from detrace.state import checkpoint

    given = tmp_path / "given"
    checkpoint.write(given, step=2, shared={"w": torch.ones(2)}, local={})  # taken after 2 steps
    launched: list[str] = []
    result = recheck(_original(tmp_path, None), step=2, out=tmp_path / "out", checkpoint=given,
                     launch=_fake_launcher({}, launched))
    assert launched == ["same", "other"] and result.verdict == "clean"
    assert not (tmp_path / "out" / "prepare").exists() and (tmp_path / "out" / "checkpoint").is_dir()
    with pytest.raises(UsageError, match=r"taken after 2 steps, past step 1: give one taken at or before step 1"):
        recheck(tmp_path / "run", step=1, out=tmp_path / "late", checkpoint=given,
                launch=_fake_launcher({}, launched))
    assert launched == ["same", "other"]  # refused before any run


def test_recheck_refuses_another_runs_checkpoint_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint saved by another traced command (its manifest names it) or by another world size is not this
    run's: refused before any run, not judged an inexact resume of this program."""
    from detrace.record.config import TraceConfig
    from detrace.state import checkpoint

    run = _original(tmp_path, None)
    for command in (("python", "other.py"), ("python", "train.py")):
        monkeypatch.setenv("DETRACE_TRACE", TraceConfig(out=tmp_path / "t", command=command).to_env())
        checkpoint.write(tmp_path / command[1], step=2, shared={"w": torch.ones(2)}, local={})
    monkeypatch.delenv("DETRACE_TRACE")
    launched: list[str] = []
    with pytest.raises(UsageError, match=r"is not this run's: it was saved by `python other\.py`, and .* is a run of "
                                         r"`python train\.py`; give a checkpoint of this run"):
        recheck(run, step=2, out=tmp_path / "other", checkpoint=tmp_path / "other.py",
                launch=_fake_launcher({}, launched))
    assert launched == []
    result = recheck(run, step=2, out=tmp_path / "own", checkpoint=tmp_path / "train.py",
                     launch=_fake_launcher({}, launched))
    assert result.verdict == "clean" and launched == ["same", "other"]
    write_json_atomic(run_header_path(run), {"command": ["python", "train.py"], "world_size": 2})
    with pytest.raises(UsageError, match=r"saved by 1 ranks, and .* ran 2"):
        recheck(run, step=2, out=tmp_path / "wide", checkpoint=tmp_path / "train.py",
                launch=_fake_launcher({}, launched))


def test_recheck_command_prints_the_verdict_and_exits_with_its_code(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import functools
    import json

    from detrace.cli import main as cli
    from detrace.cli import recheck as command

    run = _original(tmp_path, None)
    monkeypatch.setattr(command, "recheck", functools.partial(recheck, launch=_fake_launcher(
        {"same": FLIP, "other": FLIP}, [])))  # an inexact resume: the re-executions agree, the run does not
    assert cli(["recheck", str(run), "--step", "2", "--out", str(tmp_path / "json"), "--json"]) == 2
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["verdict"] == "inexact-resume" and result["resume_exact"] is False
    assert result["same_device"] == {"0": False} and result["other_device"] == {"0": False}
    assert f"detrace recheck: step 2 on the same devices: {tmp_path / 'json' / 'same'}" in captured.err
    monkeypatch.setattr(command, "recheck", functools.partial(recheck, launch=_fake_launcher({}, [])))
    assert cli(["recheck", str(run), "--step", "2", "--out", str(tmp_path / "clean")]) == 0
    assert capsys.readouterr().out.startswith("clean: step 2 re-executed on the same and on other devices")


def test_recheck_needs_no_proof_when_the_step_is_reproduced(tmp_path: Path) -> None:
    launched: list[str] = []
    result = recheck(_original(tmp_path, None), step=2, out=tmp_path / "out",
                     launch=_fake_launcher({"other": FLIP}, launched))
    assert launched == ["prepare", "same", "other"]
    assert result.verdict == "persistent" and result.resume_exact is None


def test_recheck_refuses_a_checkpoint_whose_parameters_are_not_the_runs(tmp_path: Path) -> None:
    """#49.10: a checkpoint saved outside a traced run names no command; another run's was re-executed and judged an
    inexact resume of this one. The run's trace holds its parameters after the step before the checkpoint: one that
    differs there is not this run's checkpoint, refused before any run."""
    from detrace.digest import fingerprint
    from detrace.state import checkpoint

    weight = torch.arange(4.0)
    run = tmp_path / "run"
    write_training_rank(run, 0, [TrainingStep(step=s, params={"w": fingerprint(weight + s).digest})
                                 for s in range(3)], world_size=1)
    write_json_atomic(run_header_path(run), {"command": ["python", "train.py"], "world_size": 1})
    checkpoint.write(tmp_path / "own", step=2, shared={"model": {"w": weight + 1}}, local={})  # after steps 0-1
    checkpoint.write(tmp_path / "foreign", step=2, shared={"model": {"w": weight + 9}}, local={})
    launched: list[str] = []
    ours, theirs = f"{fingerprint(weight + 1).digest:x}", f"{fingerprint(weight + 9).digest:x}"
    with pytest.raises(UsageError, match=rf"checkpoint {tmp_path / 'foreign'} is not this run's: its parameter w "
                                         rf"\({theirs}\) differs from the run's \({ours}, recorded in .* after step "
                                         rf"1\); give a checkpoint of this run$"):
        recheck(run, step=2, out=tmp_path / "out", checkpoint=tmp_path / "foreign",
                launch=_fake_launcher({}, launched))
    assert launched == []
    recheck(run, step=2, out=tmp_path / "out-own", checkpoint=tmp_path / "own", launch=_fake_launcher({}, launched))
    assert launched[:2] == ["same", "other"]  # its own checkpoint is re-executed

def _sgd_steps(steps: int) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(("spec", "words"), [
    ("bitflip:step=0,rank=0,tensor=no.such.weight,bit=1",
     "names tensor no.such.weight, which is no parameter of the optimizer"),
    ("bitflip:step=0,rank=5,tensor=weight,bit=1", "strikes rank 5, and the job has 1 rank"),
    ("bitflip:step=0,rank=0,tensor=nowhere.output,bit=1", "module nowhere, which this program does not hold"),
    ("bitflip:step=9,rank=0,tensor=weight,bit=1", "strikes at step 9, and this process's last step was 1"),
])
def test_a_fault_that_can_never_strike_is_said(spec: str, words: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    injector = FaultInjector(FaultSpec.parse(spec))
    injector.install()
    try:
        _sgd_steps(2)
        injector.report_at_exit()
    finally:
        injector.remove()
    err = capsys.readouterr().err
    assert f"{words}: it can never strike" in err and err.count("\n") == 1 and not injector.struck


def test_a_fault_that_strikes_is_not_warned_about(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    injector = FaultInjector(FaultSpec.parse("bitflip:step=1,rank=0,tensor=weight,bit=1"))
    injector.install()
    try:
        _sgd_steps(2)
        injector.report_at_exit()
    finally:
        injector.remove()
    assert injector.struck == [1] and capsys.readouterr().err == ""


def test_bad_guard_or_fault_variables_never_break_a_detrace_command(tmp_path: Path) -> None:
    env = {**os.environ, "DETRACE_GUARD": "often", "DETRACE_FAULT": "bitflip:step=²,rank=0,tensor=w,bit=1"}
    proc = subprocess.run([PY, "-m", "detrace", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "check" in proc.stdout


def test_bad_variables_in_a_training_process_are_one_sentence_each_and_the_program_runs_on(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_GUARD", "often")
    monkeypatch.setenv("DETRACE_FAULT", "bitflip:step=x")
    arm_from_env()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"detrace: DETRACE_GUARD='often' must be N or N:warn with N a positive integer; the replica guard "
                   f"is off in process {os.getpid()}",
                   f"detrace: DETRACE_FAULT: step must be a non-negative integer, not 'x'; the injected fault is off "
                   f"in process {os.getpid()}"]


@pytest.mark.parametrize(("variable", "value"), [("DETRACE_FINGERPRINT_BACKEND", "bogus"),
                                                 ("DETRACE_STEP_OFFSET", "x")])
def test_the_tracer_refuses_a_bad_variable_at_its_start_not_at_its_first_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    import detrace

    monkeypatch.setenv(variable, value)
    with pytest.raises(UsageError, match=variable), detrace.trace(tmp_path / "t"):
        pass
    assert detrace.record.active() is None


def test_a_garbage_audit_variable_is_one_sentence_naming_it_and_the_trace_is_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import detrace.record
    from detrace.investigate.audit import probe
    from detrace.record.config import ENV_VAR, TraceConfig

    monkeypatch.setenv(ENV_VAR, TraceConfig(out=tmp_path / "t", launched=True).to_env())
    monkeypatch.setenv("DETRACE_AUDIT", "garbage")
    try:
        assert detrace.record.arm_from_env()
        probe.arm_from_env()  # as the start-up hook arms it next; an "invalid literal for int()" traceback once
        err = capsys.readouterr().err
        assert err == (f"detrace: DETRACE_AUDIT must be a positive number of steps, not 'garbage'; the audit is off "
                       f"in process {os.getpid()}\n")
        detrace.record.metric("loss", 1.0)
        detrace.record.step()
    finally:
        detrace.record._stop()
    assert (tmp_path / "t" / "rank-00000.json").is_file()  # closed


def test_recheck_compares_module_buffers_too(tmp_path: Path) -> None:
    # A flip that lands only in a module buffer (a running mean) leaves every parameter as it was: recheck's
    # results hold the buffers, so the re-executions are judged on them too.
    def traced(name: str, mean: int) -> Path:
        write_training_rank(tmp_path / name, 0, [TrainingStep(step=1, losses=(1.0,), params={"w": 7},
                                                                buffers={"bn.running_mean": mean})], world_size=1)
        return tmp_path / name
    original, flipped = step_results(traced("a", 1), 1), step_results(traced("b", 2), 1)
    assert original[0][("bn.running_mean", "buffer", 0, 0)] == 1
    assert judge(original, original, flipped) == ("persistent", (0,))
