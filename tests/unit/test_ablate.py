"""`detrace ablate`'s decision logic in process: a fake launcher writes synthetic traces of a world whose spike
has a known cause, and the verdict must name it."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from _synthetic import write_metric_run

from detrace.cli import main
from detrace.cli.ablate import render, run_ablation
from detrace.errors import CommandFailed, UsageError
from detrace.investigate.ablate import AblateConfig, ablate, parse_variant
from detrace.state.manifest import MANIFEST_FILE

S, LAST = 12, 14
SPIKE = 3.0


def base(step: int) -> float:
    return 7.0 - 0.05 * step + (0.01 if step % 3 == 0 else -0.01)


def batch_of(step: int, start: int, env: Mapping[str, str]) -> int:
    """Which batch (by the step that trains on it in the original run) global step `step` gets, by the data
    controls, in a run that started at `start`."""
    batch = step + int(env.get("DETRACE_DATA_SHIFT", "0"))
    if "DETRACE_SKIP_STEPS" in env:
        low, high = (int(x) for x in env["DETRACE_SKIP_STEPS"].split("-"))
        if step >= low:
            batch += high - low + 1
    return batch


BATCH = 8
POISON = S * BATCH + 5
"""The dataset index of the one poisoned sample: the 6th of the batch of S (the world's sampler hands out the
indices in order, BATCH a step)."""


def samples_of(step: int, start: int, env: Mapping[str, str]) -> list[int]:
    """The dataset indices of the batch global step `step` trains on, in a run that started at `start`: the data
    controls move whole batches, DETRACE_DROP_SAMPLES takes samples out of the stream (the next ones fill in), as
    the integrations' sampler does."""
    dropped = {int(i) for i in env.get("DETRACE_DROP_SAMPLES", "").split(",") if i}
    batch = batch_of(step, start, env)
    stream = [i for i in range(start * BATCH, (batch + 1) * BATCH + len(dropped)) if i not in dropped]
    return stream[(batch - start) * BATCH:][:BATCH]


def loss(kind: str, step: int, batch: list[int], args: Sequence[str], env: Mapping[str, str]) -> float:
    """The world: a spike at S caused by the poisoned sample (data), by step S whatever its batch (state), by both
    together, or by a setting that --lr or ENV FIX=1 turns off."""
    poisoned = POISON in batch
    spiked = {"data": poisoned, "state": step == S, "both": step == S and poisoned,
              "either": poisoned or POISON - 4 in batch,  # two poisoned samples of one batch, each enough alone
              "setting": step == S and "--lr" not in args and env.get("FIX") != "1", "none": False}[kind]
    return base(step) + (SPIKE if spiked else 0.0)


class World:
    """A fake launcher: each call writes the synthetic trace a run of the world would record."""

    def __init__(self, kind: str, *, drift: int | None = None, samples: bool = True, part: str | None = None
                 ) -> None:
        # part: the world applies DETRACE_RESTORE_PART (None: it ignores it, as a program without TrainState), and
        # the state spike is in that part of the checkpoint after 8 steps ("step": in none, it is bound to the
        # step), so that part from the checkpoint after 4 steps removes it.
        self.kind, self.drift, self.samples, self.part = kind, drift, samples, part
        self.calls: list[tuple[tuple[str, ...], dict[str, str]]] = []

    def __call__(self, cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        self.calls.append((tuple(cmd), dict(env)))
        start = int(Path(env["DETRACE_RESUME_FROM"]).name.split("-")[1]) if "DETRACE_RESUME_FROM" in env else 0
        stop = int(env["DETRACE_STOP_AT"])
        args = tuple(cmd[1:])
        values = {t: base(t) for t in range(stop)}
        samples = {t: samples_of(t, start, env) for t in range(start, stop)}
        restored = env.get("DETRACE_RESTORE_PART", ":").split(":")[0] if self.part is not None else ""
        for t in range(start, stop):
            values[t] = loss(self.kind, t, samples[t], args, env)
            if restored:
                values[t] += 1e-3 * (t - start + 1)  # another state: another run from its first step
                if restored == self.part and t == S:
                    values[t] -= SPIKE
            if t == self.drift:
                values[t] += 1e-6  # the replay does not reproduce the original run here
        write_metric_run(out, values, first=start, samples=samples if self.samples else None)
        return 1.5


def original(tmp_path: Path, kind: str) -> Path:
    """The original traced run (global steps 0..LAST) and its checkpoints after 4 and 8 steps."""
    run, ckpts = tmp_path / "original", tmp_path / "ckpt"
    write_metric_run(run, {t: loss(kind, t, samples_of(t, 0, {}), (), {}) for t in range(LAST + 1)})
    for step in (4, 8):
        version = ckpts / f"step-{step:08d}"
        version.mkdir(parents=True)
        (version / MANIFEST_FILE).write_text("{}")
    (run / "run.json").write_text(json.dumps({"rung": "metrics", "checkpoint_dir": str(ckpts)}))
    return run


def config(tmp_path: Path, run: Path, **kwargs: object) -> AblateConfig:
    return AblateConfig(command=("train",), run=run, step=S, out=tmp_path / "ablate", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["data", "state", "both"])
def test_each_cause_gets_its_verdict(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    world = World(kind)
    result = ablate(config(tmp_path, original(tmp_path, kind)), world)
    assert result.verdict == "isolated" and result.exit_code == 1
    assert result.cause == kind, result.summary
    assert result.summary.startswith(f"{kind}: ")
    assert result.checkpoint == 8
    spiked = {o.variant.name: o.spiked for o in result.outcomes}
    expected = {"data": {"skip-batches": False, "state-only": False, "data-from-earlier": True},
                "state": {"skip-batches": True, "state-only": True, "data-from-earlier": False},
                "both": {"skip-batches": False, "state-only": False, "data-from-earlier": False}}[kind]
    assert spiked == expected
    # The runs: the baseline and skip-batches from C = 8, data-from-earlier from C' = 4 fed 4 batches ahead.
    envs = {call[1].get("DETRACE_SKIP_STEPS") or call[1].get("DETRACE_DATA_SHIFT") or "base": call[1]
            for call in world.calls}
    assert envs["8-12"]["DETRACE_RESUME_FROM"].endswith("step-00000008")  # by default the window starts at C
    assert envs["4"]["DETRACE_RESUME_FROM"].endswith("step-00000004") and envs["4"]["DETRACE_STOP_AT"] == "11"
    assert envs["base"]["DETRACE_STOP_AT"] == "15"
    earlier = next(o for o in result.outcomes if o.variant.name == "data-from-earlier")
    assert earlier.at == 8 and earlier.departure is None
    skip = next(o for o in result.outcomes if o.variant.name == "skip-batches")
    # The first record that differs: the samples of the first step skipped.
    assert skip.departure is not None and (skip.departure.step, skip.departure.name) == (8, "samples")
    if kind == "state":
        # The split: the world ignores DETRACE_RESTORE_PART, so its three replays computed the baseline's bits and
        # no part is named.
        assert result.samples is None and len(world.calls) == 7 and result.split is not None
        assert [o.variant.env for o in result.split.replays] == [
            {"DETRACE_RESTORE_PART": f"{part}:{tmp_path / 'ckpt' / 'step-00000004'}"}
            for part in ("lr", "moments", "weights")]
        assert result.split.parts == () and all(o.departure is None for o in result.split.replays)
        assert result.summary.endswith("; which part of the state carries it could not be split; restore-lr, "
                                       "restore-moments, restore-weights computed the baseline's very bits (that part "
                                       "is the same in both checkpoints, or the program does not apply "
                                       "DETRACE_RESTORE_PART: TrainState and detrace's integrations do), so it is no "
                                       "evidence about its part")
        return
    # The sample: the baseline's trace names S's batch (96-103); dropping 96-99 leaves the spike, so it is in
    # 100-103; dropping 100-101 removes it; dropping 100 leaves it; 101 alone is confirmed: 4 replays, each from C,
    # each departing at S.
    bisected = result.samples
    assert bisected is not None and bisected.indices == tuple(range(S * BATCH, S * BATCH + BATCH))
    assert bisected.culprit == POISON and bisected.note.startswith(
        f"the sample is dataset index {POISON}, sample 6 of the 8 of step 12's batch (on rank 0)")
    assert [o.variant.env["DETRACE_DROP_SAMPLES"] for o in bisected.replays] == ["96,97,98,99", "100,101", "100", "101"]
    assert all(o.variant.start == 8 and o.departure and o.departure.step == S for o in bisected.replays)
    assert [o.spiked for o in bisected.replays] == [True, False, True, False]
    assert bisected.note in result.summary and len(world.calls) == 8
    assert result.to_json()["cost"] == {"runs": 8, "steps": 8 * 7, "seconds": 8 * 1.5}  # the bisection's runs too
    render(result)
    printed = capsys.readouterr().out
    assert "  samples  of step 12: 96, 97, 98, 99, 100, 101, 102, 103; the one it needs: dataset index 101\n" in printed
    assert "  drop-4" in printed and "  cost     8 runs, 56 steps, 12.0 s" in printed


def test_a_data_verdict_names_the_step_of_the_spike_not_a_letter(tmp_path: Path) -> None:
    """#46.6: the summary said "with the batch of step S replaced", the letter of the usage line, not the step."""
    result = ablate(config(tmp_path, original(tmp_path, "data")), World("data"))
    assert result.cause == "data" and "step S " not in result.summary
    assert f"; with the batch of step {S} replaced, the same state does not spike" in result.summary

@pytest.mark.parametrize("part", ["lr", "moments", "weights", "step"])
def test_a_state_verdict_names_the_part_that_carries_it(part: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    result = ablate(config(tmp_path, original(tmp_path, "state")), World("state", part=part))
    assert result.cause == "state" and result.split is not None and result.split.earlier == 4
    removed = {o.variant.name: not o.spiked for o in result.split.replays}
    assert removed == {f"restore-{name}": name == part for name in ("lr", "moments", "weights")}
    assert all(o.variant.start == 8 and o.departure is not None for o in result.split.replays)
    if part == "step":
        assert result.split.parts == () and result.summary.endswith(
            "; no part of the state alone carries it: restore-lr, restore-moments, restore-weights (each part from "
            "the checkpoint after 4 steps) still spike")
    else:
        assert result.split.parts == (part,) and result.summary.endswith(
            f"; the state's part that carries it: {part} (from the checkpoint after 4 steps, the rest from the one "
            "after 8 steps, removes the spike)")
    render(result)
    printed = capsys.readouterr().out
    named = "-" if part == "step" else part
    assert (f"  state    at step 8, one part at a time from the checkpoint after 4 steps; the part that carries it: "
            f"{named}\n") in printed and "  cost     7 runs, 49 steps, 10.5 s" in printed


def test_a_state_verdict_without_an_earlier_checkpoint_is_not_split(tmp_path: Path) -> None:
    run = original(tmp_path, "state")
    world = World("state", part="weights")
    result = ablate(config(tmp_path, run, checkpoint=tmp_path / "ckpt" / "step-00000004"), world)
    assert result.cause == "state" and result.split is not None and result.split.replays == ()
    assert len(world.calls) == 4 and result.summary.endswith(
        "; which part of the state carries it is not split: the run saved no checkpoint before the one after 4 "
        "steps to take a part from")


def test_a_nan_spike_is_a_spike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN compares false with every threshold: the batch that makes the loss NaN is still found, not "no-spike"."""
    monkeypatch.setattr(sys.modules[__name__], "SPIKE", math.nan)
    result = ablate(config(tmp_path, original(tmp_path, "data")), World("data"))
    assert (result.verdict, result.cause) == ("isolated", "data"), result.summary
    spiked = {o.variant.name: o.spiked for o in result.outcomes}
    assert spiked == {"skip-batches": False, "state-only": False, "data-from-earlier": True}
    assert result.outcomes[-1].variant.name == "data-from-earlier"  # the NaN ranks last


def test_the_variants_are_ranked_by_their_effect(tmp_path: Path) -> None:
    result = ablate(config(tmp_path, original(tmp_path, "data")), World("data"))
    values = [o.value for o in result.outcomes]
    assert values == sorted(values)  # type: ignore[type-var]
    assert not result.outcomes[0].spiked and result.outcomes[-1].spiked


def test_a_user_variant_that_removes_the_spike_is_a_setting(tmp_path: Path) -> None:
    world = World("setting")
    result = ablate(config(tmp_path, original(tmp_path, "setting"), builtins=False,
                           variants=("lr_half=--lr 1.5e-3", "fixed=ENV:FIX=1", "noop=ENV:OTHER=1")), world)
    assert result.cause == "setting", result.summary
    assert result.summary.startswith("setting: no change of data or state removes the spike at step 12, but "
                                     "lr_half, fixed do; noop computed the baseline's very bits: nothing it changes "
                                     "reaches the computation after the checkpoint")
    by_name = {o.variant.name: o for o in result.outcomes}
    assert not by_name["lr_half"].spiked and not by_name["fixed"].spiked and by_name["noop"].spiked
    assert ("train", "--lr", "1.5e-3") in [call[0] for call in world.calls]
    assert by_name["fixed"].variant.env == {"FIX": "1"} and len(world.calls) == 4  # baseline + 3


def test_a_step_bound_setting_reads_as_state_and_names_the_user_variants(tmp_path: Path) -> None:
    result = ablate(config(tmp_path, original(tmp_path, "setting"), variants=("fixed=ENV:FIX=1",)), World("setting"))
    assert result.cause == "state" and "; fixed also removes it; " in result.summary


def test_no_spike_in_the_baseline_exits_0_after_one_run(tmp_path: Path) -> None:
    world = World("none")
    result = ablate(config(tmp_path, original(tmp_path, "none")), world)
    assert (result.verdict, result.exit_code, len(world.calls)) == ("no-spike", 0, 1)
    assert "under the threshold" in result.summary


def test_a_replay_that_does_not_reproduce_is_refused(tmp_path: Path) -> None:
    world = World("data", drift=10)
    result = ablate(config(tmp_path, original(tmp_path, "data")), world)
    assert (result.verdict, result.exit_code, len(world.calls)) == ("not-reproducible", 2, 1)
    assert "rank 0, step 10: loss" in result.summary and "nothing can be isolated" in result.summary


def test_from_overrides_the_checkpoint(tmp_path: Path) -> None:
    run = original(tmp_path, "data")
    result = ablate(config(tmp_path, run, checkpoint=tmp_path / "ckpt" / "step-00000004"), World("data"))
    assert result.checkpoint == 4 and result.cause == "data"
    earlier = next(o for o in result.outcomes if o.variant.name == "data-from-earlier")
    assert earlier.variant.start == 0 and earlier.variant.resume_from is None  # a fresh start fed 4 batches ahead


def test_errors_are_usage_errors(tmp_path: Path) -> None:
    run = original(tmp_path, "data")
    with pytest.raises(UsageError, match="no checkpoint before step 3"):
        ablate(AblateConfig(command=("t",), run=run, step=3, out=tmp_path / "x"), World("data"))
    for spec in ("novalue", "baseline=--x", "x=ENV:1=2", "x="):
        with pytest.raises(UsageError):
            parse_variant(spec)
    assert parse_variant("fp32=ENV:DTYPE=fp32,A=b") == ("fp32", {"DTYPE": "fp32", "A": "b"}, ())

    def failing(cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        raise CommandFailed("CMD exited with status 1")

    with pytest.raises(CommandFailed):
        ablate(config(tmp_path, run), failing)


def test_the_directory_holds_json_and_a_report(tmp_path: Path) -> None:
    result = run_ablation(config(tmp_path, original(tmp_path, "state")), World("state"))
    record = json.loads((result.config.out / "ablate.json").read_text())
    assert record["schema"] == "detrace.ablate/1" and record["cause"] == "state" and record["exit_code"] == 1
    assert record["cost"] == {"runs": 7, "steps": 7 * 7, "seconds": 7 * 1.5} and record["samples"] is None
    assert [replay["name"] for replay in record["split"]["replays"]] == [
        "restore-lr", "restore-moments", "restore-weights"]
    assert record["variants"][0]["name"] == "data-from-earlier"
    page = (result.config.out / "report.html").read_text()
    assert "detrace ablate" in page and page.count("<svg") == 4 and "state: the spike survives" in page
    assert main(["report", str(result.config.out)]) == 0


def test_the_command_refuses_without_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ablate", "--run", "x", "--", "train"]) == 2
    assert "--step" in capsys.readouterr().err


def test_state_only_resumes_from_the_checkpoint_at_s_when_there_is_one(tmp_path: Path) -> None:
    run = original(tmp_path, "data")
    version = tmp_path / "ckpt" / f"step-{S:08d}"
    version.mkdir()
    (version / MANIFEST_FILE).write_text("{}")
    result = ablate(config(tmp_path, run), World("data"))
    only = next(o for o in result.outcomes if o.variant.name == "state-only")
    assert only.variant.start == S and not only.spiked and result.checkpoint == 8 and result.cause == "data"
    assert only.departure is not None and only.departure.step == S


def test_a_semantic_original_is_held_to_every_record(tmp_path: Path) -> None:
    from _synthetic import Fault

    from detrace.investigate.ablate import reproduces

    values = {t: base(t) for t in range(LAST + 1)}
    original_run, same, faulty = tmp_path / "o", tmp_path / "same", tmp_path / "faulty"
    for out, fault in ((original_run, None), (same, None), (faulty, Fault(rank=1, step=10, op=1))):
        write_metric_run(out, values, ranks=2, fault=fault, first=0 if out == original_run else 8)
    (original_run / "run.json").write_text(json.dumps({"rung": "semantic"}))
    assert reproduces(original_run, same, 9, S) is None
    assert reproduces(original_run, faulty, 9, S) == "rank 0, step 10: collective all_reduce#0 output[0] differs"
    (original_run / "run.json").write_text(json.dumps({"rung": "metrics"}))
    assert reproduces(original_run, faulty, 9, S) is None  # the same losses: a metrics-rung original cannot tell


class Framework(World):
    """A world whose program applies the data controls only where a run starts, and refuses a skip elsewhere
    (as the HF and Lightning callbacks do)."""

    def __call__(self, cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        start = int(Path(env["DETRACE_RESUME_FROM"]).name.split("-")[1]) if "DETRACE_RESUME_FROM" in env else 0
        if "DETRACE_SKIP_STEPS" in env and int(env["DETRACE_SKIP_STEPS"].split("-")[0]) != start:
            self.calls.append((tuple(cmd), dict(env)))
            raise CommandFailed(f"CMD exited with status 1 in {out.name}: the callback applies DETRACE_SKIP_STEPS "
                                "where the run starts")
        return super().__call__(cmd, out, env)


def test_a_variant_that_cannot_run_is_unavailable_and_the_verdict_comes_from_the_others(tmp_path: Path) -> None:
    result = run_ablation(config(tmp_path, original(tmp_path, "data")), Framework("data"))
    assert (result.verdict, result.cause) == ("isolated", "data"), result.summary
    by_name = {o.variant.name: o for o in result.outcomes}
    assert by_name["state-only"].unavailable is not None and "DETRACE_SKIP_STEPS" in by_name["state-only"].unavailable
    assert by_name["skip-batches"].unavailable is None and not by_name["skip-batches"].spiked
    assert result.summary.endswith("; state-only could not run (ablate.json says why), the verdict comes from the "
                                   "others")
    record = json.loads((result.config.out / "ablate.json").read_text())
    [only] = [v for v in record["variants"] if v["name"] == "state-only"]
    assert only["unavailable"].startswith("CMD exited with status 1") and only["value"] is None

    def refuses_every_variant(cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        if out.name != "baseline":
            raise CommandFailed("CMD exited with status 1; the end of its output: Traceback ...\n  File ...\n"
                                "UsageError: past the end of its epoch")
        return World("data")(cmd, out, env)

    result = ablate(dataclasses.replace(result.config, out=tmp_path / "none"), refuses_every_variant)
    assert result.cause == "undetermined" and result.summary.startswith(
        "undetermined: no variant could run from the checkpoint after 8 steps")  # not "survives every variant"
    assert {o.unavailable.split(" (its run")[0] for o in result.outcomes} == {  # type: ignore[union-attr]
        "UsageError: past the end of its epoch"}


def test_hostile_options_are_refused_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = original(tmp_path, "data")
    world = World("data")
    with pytest.raises(UsageError, match=r"^--variant \"q='unterminated\": its arguments do not parse"):
        parse_variant("q='unterminated")
    assert main(["ablate", "--step", "12", "--run", str(run), "--variant", "q='unterminated", "--", "t"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("detrace ablate: error: --variant") and err.count("\n") == 1
    with pytest.raises(UsageError, match=r"^the original run recorded no loss at step 100 \(its last step is 14\)$"):
        ablate(AblateConfig(command=("t",), run=run, step=100, out=tmp_path / "x"), world)
    with pytest.raises(UsageError, match=r"^--variant a given twice"):
        config(tmp_path, run, variants=("a=--lr 1", "a=ENV:X=1"))
    assert world.calls == []


@pytest.mark.parametrize("variable", ["DETRACE_CKPT_DIR", "DETRACE_RESUME_FROM", "DETRACE_CKPT_EVERY",
                                      "DETRACE_RESUME"])
def test_a_variant_cannot_point_the_contract_at_the_original_runs_checkpoints(variable: str) -> None:
    # ENV:DETRACE_CKPT_DIR=<the original's checkpoints> added versions there and moved its `latest`.
    with pytest.raises(UsageError, match=f"sets {variable}, which ablate sets for each run itself"):
        parse_variant(f"mine=ENV:A=1,{variable}=runs/original/ckpt")


class IgnoresDrops(World):
    """A program that does not know DETRACE_DROP_SAMPLES (its sampler is not detrace's): it trains on them."""

    def __call__(self, cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        return super().__call__(cmd, out, {k: v for k, v in env.items() if k != "DETRACE_DROP_SAMPLES"})


def test_no_sample_is_named_without_evidence_about_the_batch_of_s(tmp_path: Path) -> None:
    # No sample indices in the trace: nothing to bisect, and no run spent on it.
    world = World("data", samples=False)
    result = ablate(config(tmp_path, original(tmp_path, "data")), world)
    assert result.cause == "data" and result.samples is not None and result.samples.culprit is None
    assert "the trace names no sample of step 12's batch" in result.summary and len(world.calls) == 4
    # A program that ignores the drop: its replay is the baseline's, bit for bit, and the bisection stops there
    # instead of reading "still spikes" as "not in this half".
    result = ablate(config(tmp_path / "b", original(tmp_path / "b", "data")), IgnoresDrops("data"))
    assert result.samples is not None and result.samples.culprit is None and len(result.samples.replays) == 1
    assert "drop-1 did not drop samples 96,97,98,99 from step 12's batch alone" in result.summary
    # Two poisoned samples, either enough: no single drop removes the spike, and none is named.
    result = ablate(config(tmp_path / "c", original(tmp_path / "c", "either")), World("either"))
    assert result.cause == "data" and result.samples is not None and result.samples.culprit is None
    assert "no single sample of step 12's batch carries the spike alone" in result.summary
    assert result.to_json()["samples"]["culprit"] is None
