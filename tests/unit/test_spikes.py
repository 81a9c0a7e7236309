"""`detrace spikes`: the robust threshold on synthetic series and on synthetic traces, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _synthetic import write_metric_run

from detrace.cli import main
from detrace.errors import UsageError
from detrace.investigate.spikes import SpikeRule, checkpoint_before, find_spikes, spikes


def falling(steps: int, *, noise: float = 0.01) -> dict[int, float]:
    """A loss that falls steadily with a small alternating wobble: what a clean run looks like."""
    return {s: 7.0 - 0.05 * s + (noise if s % 3 == 0 else -noise) for s in range(steps)}


def test_a_clean_falling_loss_has_no_spike() -> None:
    assert find_spikes(falling(40), SpikeRule()) == []


def test_planted_steps_are_found_with_their_threshold() -> None:
    series = falling(40)
    series[12] += 1.5
    series[30] += 1.2
    found = find_spikes(series, SpikeRule())
    assert [step for step, _, _ in found] == [12, 30]
    _, value, threshold = found[0]
    history = [series[s] for s in range(2, 12)]  # the window: the 10 steps before
    assert value == series[12] and threshold < value and threshold > max(history) - 0.2


def test_a_spike_inside_the_window_does_not_hide_the_next_one() -> None:
    series = falling(30)
    series[10] += 2.0
    series[13] += 2.0  # the MAD ignores the earlier outlier that a standard deviation would be pulled up by
    assert [s for s, _, _ in find_spikes(series, SpikeRule())] == [10, 13]


def test_steps_without_enough_history_are_not_judged() -> None:
    series = {0: 1.0, 1: 1.0, 2: 100.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 50.0}
    assert [s for s, _, _ in find_spikes(series, SpikeRule(window=4))] == [7]


def test_the_rule_refuses_bad_options() -> None:
    with pytest.raises(UsageError, match="--k"):
        SpikeRule(k=0)
    with pytest.raises(UsageError, match="--window"):
        SpikeRule(window=2)


def test_checkpoint_before_is_the_last_one_strictly_before_the_step() -> None:
    versions = {4: Path("a"), 8: Path("b"), 12: Path("c")}
    assert checkpoint_before(versions, 12) == 8
    assert checkpoint_before(versions, 9) == 8
    assert checkpoint_before(versions, 4) is None


def test_spikes_on_a_synthetic_trace_names_its_checkpoint(tmp_path: Path) -> None:
    series = falling(20)
    series[14] += 2.0
    run = tmp_path / "run"
    write_metric_run(run, series, ranks=2)
    ckpts = tmp_path / "ckpt"
    _fake_checkpoint(ckpts, 10)
    result = spikes(run, checkpoints=ckpts)
    assert result.verdict == "spikes" and result.exit_code == 1
    (spike,) = result.spikes
    assert (spike.step, spike.value, spike.checkpoint) == (14, series[14], 10)
    assert spike.checkpoint_path == str(ckpts / "step-00000010")


def test_the_command_prints_json_and_exits_by_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean, spiky = tmp_path / "clean", tmp_path / "spiky"
    write_metric_run(clean, falling(20))
    series = falling(20)
    series[15] *= 2
    write_metric_run(spiky, series)
    assert main(["spikes", str(clean)]) == 0
    assert "clean: no spike in loss" in capsys.readouterr().out
    assert main(["spikes", str(spiky), "--json", "--k", "5", "--window", "6"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "detrace.spikes/1" and [s["step"] for s in out["spikes"]] == [15]
    assert out["k"] == 5 and out["window"] == 6 and out["spikes"][0]["checkpoint"] is None
    assert main(["spikes", str(spiky), "--metric", "lr"]) == 2
    assert "recorded no metric 'lr'" in capsys.readouterr().err


def _fake_checkpoint(root: Path, step: int) -> None:
    """A checkpoint version directory as `saved_versions` recognises it: complete once its manifest is there."""
    from detrace.state.manifest import MANIFEST_FILE

    version = root / f"step-{step:08d}"
    version.mkdir(parents=True)
    (version / MANIFEST_FILE).write_text("{}")


def test_the_checkpoint_directory_comes_from_run_json(tmp_path: Path) -> None:
    series = falling(20)
    series[16] += 3.0
    run, ckpts = tmp_path / "run", tmp_path / "ckpt"
    write_metric_run(run, series)
    _fake_checkpoint(ckpts, 8)
    _fake_checkpoint(ckpts, 12)
    (run / "run.json").write_text(json.dumps({"checkpoint_dir": str(ckpts)}))
    (spike,) = spikes(run).spikes
    assert (spike.step, spike.checkpoint) == (16, 12)


def test_nan_and_inf_are_always_spikes_the_first_named() -> None:
    series = {s: 1.0 for s in range(8)}
    series[5] = float("nan")
    assert [(s, str(v)) for s, v, _ in find_spikes(series, SpikeRule())] == [(5, "nan")]
    series[1], series[6] = float("inf"), float("nan")  # too early to be judged, and still a spike; later ones counted
    assert [s for s, _, _ in find_spikes(series, SpikeRule())] == [1]


def test_a_one_ulp_bump_of_a_constant_loss_is_no_spike() -> None:
    import math

    series = {s: 1.0 for s in range(8)}
    series[6] = math.nextafter(1.0, 2.0)
    assert find_spikes(series, SpikeRule()) == []
    series[6] = 1.01  # a real rise over a metric that never moved is still one
    assert [s for s, _, _ in find_spikes(series, SpikeRule())] == [6]


def test_a_step_is_the_mean_of_its_micro_batches(tmp_path: Path) -> None:
    """Under gradient accumulation the loss is recorded once per micro-batch: a spike in any of them is seen."""
    import pyarrow as pa
    from _synthetic import write_table

    from detrace.tracefile import ARROW_SCHEMA, read_rank

    run = tmp_path / "run"
    write_metric_run(run, falling(12))
    rows = read_rank(run, 0).table.to_pylist()
    out = []
    for row in rows:  # two micro-batches per step: the first one spikes at step 9, the last one never
        if row["role"] == "metric":
            out.append({**row, "value": row["value"] + (5.0 if row["step"] == 9 else 0.0)})
            out.append({**row, "occurrence": 1})
        else:
            out.append(row)
    out = [{**row, "seq": i} for i, row in enumerate(out)]
    write_table(tmp_path / "acc", 0, pa.Table.from_pylist(out, schema=ARROW_SCHEMA), world_size=1)
    result = spikes(tmp_path / "acc")
    assert [(s.step, s.value) for s in result.spikes] == [(9, falling(12)[9] + 2.5)]


def test_a_restarted_run_in_one_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    from _synthetic import write_table

    from detrace.tracefile import ARROW_SCHEMA, read_rank

    write_metric_run(tmp_path / "run", {s: 1.0 for s in range(5)})
    rows = read_rank(tmp_path / "run", 0).table.to_pylist()
    again = [{**row, "value": 9.0 if row["step"] == 2 and row["role"] == "metric" else row["value"]}
             for row in rows if row["step"] >= 2]
    both = [{**row, "seq": i} for i, row in enumerate(rows + again)]  # steps 0..4 then 2..4: a spike at the second 2
    write_table(tmp_path / "restarted", 0, pa.Table.from_pylist(both, schema=ARROW_SCHEMA), world_size=1)
    assert main(["spikes", str(tmp_path / "restarted")]) == 2
    assert ("holds a restarted run: its 'loss' records go back from step 4 to step 2, so two runs were appended to "
            "one trace") in capsys.readouterr().err


def test_nothing_judged_and_bad_options_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metric_run(tmp_path / "short", {0: 1.0})
    assert main(["spikes", str(tmp_path / "short")]) == 2
    assert "recorded 'loss' at 1 step on rank 0: a step needs 4 earlier ones to be judged, so nothing was judged" in (
        capsys.readouterr().err)
    write_metric_run(tmp_path / "run", falling(10))
    assert main(["spikes", str(tmp_path / "run"), "--rank", "-1"]) == 2
    assert "--rank must be a rank (0 or more), not -1" in capsys.readouterr().err
    assert main(["spikes", str(tmp_path / "run"), "--checkpoints", str(tmp_path / "nonexist")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["spikes", str(tmp_path / "run")]) == 0
    assert "10 steps (6 judged)" in capsys.readouterr().out


def test_a_nan_is_named_in_the_summary_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    series = {s: 1.0 for s in range(8)}
    series[5] = series[6] = float("nan")
    write_metric_run(tmp_path / "run", series)
    assert main(["spikes", str(tmp_path / "run")]) == 1
    assert "step 5  loss nan: not finite; 1 later step not finite either" in capsys.readouterr().out
    assert main(["spikes", str(tmp_path / "run"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["spikes"][0]["value"] == "nan" and out["nonfinite"] == 2
