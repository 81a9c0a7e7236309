"""`detrace report`: the self-contained HTML of a run or locate directory, checked in a real headless browser."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from _tools import dump_dom

from detrace.analyze.locate_result import LADDER_FILE, LADDER_SCHEMA, load_ladder
from detrace.analyze.metrics import metric_rank, metric_series
from detrace.analyze.pairs import divergence_map
from detrace.cli import main
from detrace.cli.locate import render
from detrace.report.html import write_report
from detrace.report.svg import line_chart, spread_map
from detrace.report.terminal import make_console
from detrace.tracefile import RankWriter


@pytest.fixture
def runs(steady_runs: dict[str, Path]) -> tuple[Path, Path]:
    """Two real traced runs of a small deterministic training loop (3 steps, rung semantic): conftest's."""
    return steady_runs["a"], steady_runs["b"]


@pytest.mark.browser
def test_run_report_in_a_real_browser(runs: tuple[Path, Path], tmp_path: Path) -> None:
    run, _ = runs
    target = tmp_path / "nested" / "run.html"
    assert main(["report", str(run), "-o", str(target)]) == 0
    html = target.read_text()
    # self-contained: no script, no stylesheet or image from anywhere
    assert "<script" not in html and "src=" not in html and "href=" not in html
    dom = dump_dom(target)
    for text in ("detrace run", "Metric curves", "loss", "grad_norm", "Ranks", "complete"):
        assert text in dom


def test_run_report_default_path(runs: tuple[Path, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = Path(shutil.copytree(runs[1], tmp_path / "run"))  # the shared runs are read-only: write into a copy
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert (run / "report.html").stat().st_size > 1000


def test_metric_series_are_the_exact_recorded_values(runs: tuple[Path, Path]) -> None:
    run, _ = runs
    assert metric_rank(run) == 0
    series = metric_series(run, 0)
    assert set(series) >= {"loss", "grad_norm"} and sorted(series["loss"]) == [0, 1, 2]


def test_identical_runs_map_to_no_difference(runs: tuple[Path, Path]) -> None:
    spread = divergence_map(*runs)
    assert list(spread) == [0] and sorted(spread[0]) == [0, 1, 2]
    assert all(differ == 0 and total > 0 for differ, total in spread[0].values())


def _row(seq: int, step: int, name: str, digest: int) -> dict[str, object]:
    return {"seq": seq, "step": step, "rung": "semantic", "phase": "optimizer", "module": None, "name": name,
            "occurrence": 0, "event": seq, "role": "param", "index": 0, "shape": [4], "dtype": "float32",
            "numel": 4, "digest": digest, "collectives": 0}


def test_map_counts_differing_and_unmatched_records(tmp_path: Path) -> None:
    # hand-written traces: step 1 of B has a different digest for w and an extra record v
    for run, rows in (("a", [_row(0, 0, "w", 1), _row(1, 1, "w", 2)]),
                      ("b", [_row(0, 0, "w", 1), _row(1, 1, "w", 3), _row(2, 1, "v", 4)])):
        writer = RankWriter(tmp_path / run, 0, header={})
        for row in rows:
            writer.add(row)
        writer.close()
    assert divergence_map(tmp_path / "a", tmp_path / "b") == {0: {0: (0, 1), 1: (2, 2)}}


def _ladder(runs: tuple[Path, Path]) -> dict[str, Any]:
    """A ladder.json as `detrace locate` writes it, over the two real runs, with text that must be escaped."""
    culprit = {"rank": 0, "step": 1, "seq": 5, "rung": "op", "phase": "backward", "kind": "numeric",
               "name": "aten.index_put.default", "module": "blocks.<b>", "role": "output", "origin": True,
               "occurrence": 0, "index": 0, "event": 3, "detail": {}}
    stage = {"diff": None, "found": None, "note": "the runs part", "start": 0}
    arm = {"threads": 2, "deterministic": False, "repeats": 20, "distinct": 5, "differing_elements": 7,
           "max_ulp": 3, "matches_capture": False, "error": None}
    cost = {"runs": 2, "steps": 6, "seconds": 1.5, "checkpoint_every": None, "resume": "no-contract",
            "per_run": [{"run": r.name, "rung": "semantic", "start": 0, "steps": 3, "seconds": 0.75} for r in runs]}
    return {"schema": LADDER_SCHEMA, "verdict": "nondeterministic", "message": "culprit: <script>x</script>",
              "command": ["python", "t.py"], "steps": 3, "culprit": culprit,
              "culprit_records": [{"role": "input", "index": 0, "shape": [8, 4], "dtype": "float32", "numel": 32,
                                   "equal": True},
                                  {"role": "output", "index": 0, "shape": [8, 4], "dtype": "float32", "numel": 32,
                                   "equal": False}],
              "replay": {"schema": "detrace.replay/1", "op": "aten.index_put.default", "nondeterministic": True,
                         "repeats": 20, "differing_elements": 7, "max_ulp": 3,
                         "fixed_by": ["torch.use_deterministic_algorithms(True)"], "meta": {}, "shapes": [],
                         "base": arm, "arms": [arm], "advice": []},
              "stages": [{"rung": "semantic", "steps": "all", "ranks": "all", "runs": [str(r) for r in runs], **stage},
                         {"rung": "op", "steps": "1", "ranks": "0", "runs": [], **stage, "found": culprit}],
              "runs": [str(r) for r in runs], "report": "", "notes": [], "cost": cost}


@pytest.mark.browser
def test_locate_report_escapes_and_draws_every_section(runs: tuple[Path, Path], tmp_path: Path) -> None:
    ladder = _ladder(runs)
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    page = write_report(tmp_path)
    html = page.read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html and "blocks.&lt;b&gt;" in html
    dom = dump_dom(page)
    for text in ("nondeterministic", "aten.index_put.default", "Narrowing path", "differs", "equal",
                 "torch.use_deterministic_algorithms(True)", "no metric differs between the two runs"):
        assert text in dom


def test_locate_report_says_what_the_terminal_says(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 36: the terminal's notes ("the audit of the first run predicted it") were not in the report, its Runs
    table broke words mid-word ("sema ntic"), and each replay arm said "reproduces the run's bits: no" with an empty
    note."""
    ladder = _ladder(runs)
    base = ladder["replay"]["base"]
    ladder["replay"]["arms"] = [base, {**base, "threads": 1, "distinct": 1, "differing_elements": 0, "max_ulp": 0},
                                {**base, "deterministic": True, "distinct": 1, "differing_elements": 0, "max_ulp": 0}]
    ladder["notes"] = ["the audit of the first run predicted it: a certain hazard at rank 0, step 1, backward"]
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    html = write_report(tmp_path).read_text()
    sink = io.StringIO()
    render(load_ladder(tmp_path), make_console(sink))
    notes = [line.removeprefix("  note     ") for line in sink.getvalue().splitlines() if line.startswith("  note ")]
    assert notes == ladder["notes"] and all(f"<li>{note}</li>" in html for note in notes)
    assert "reproduces the run&#x27;s bits" not in html and "<td></td></tr>" not in html
    for note in ("its outputs vary from repeat to repeat; the traced run&#x27;s bits were another outcome of the "
                 "race", "one output every repeat; not the traced run&#x27;s bits, which another setting gave"):
        assert html.count(note) == (1 if "vary" in note else 2), note
    # words break only between words, but in the columns of long names: paths, modules, ops
    assert "overflow-wrap:anywhere}" not in html.split("td.any")[0]
    assert "<td>semantic</td>" in html and f'<td class="any">{runs[0]}</td>' in html


def test_charts_handle_zero_and_nan() -> None:
    svg = line_chart("d", [("x", {0: 0.0, 1: 1e-9, 2: math.nan}, "#000", False)], marks=[(1, "m", "#f00")], log=True)
    assert svg.startswith("<svg") and "0 (equal)" in svg and "nan" not in svg
    assert "1e-9" in svg or "1e-10" in svg
    grid = spread_map({0: {0: (0, 3), 1: (3, 3)}, 1: {}}, origin=(0, 1), steps=2)
    assert grid.count("<rect") == 5 and "first divergent record" in grid and "not recorded" in grid


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p / "missing", "is not a run or locate directory"),
        (lambda p: p, "neither a run directory"),
    ],
)
def test_bad_input_is_one_sentence(tmp_path: Path, make, message: str,  # type: ignore[no-untyped-def]
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unreadable_ladder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / LADDER_FILE).write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    assert "is unreadable" in capsys.readouterr().err
    (tmp_path / LADDER_FILE).write_text(json.dumps({"schema": "other/9"}))
    assert main(["report", str(tmp_path)]) == 2
    assert "has schema 'other/9'" in capsys.readouterr().err


def test_ladder_records_write_back_the_same_json(runs: tuple[Path, Path], tmp_path: Path) -> None:
    ladder = _ladder(runs)
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    record = load_ladder(tmp_path)
    assert record.culprit is not None and record.culprit.module == "blocks.<b>"
    assert record.stages[1].found == record.culprit
    assert record.exit_code == 1 and record.cost.steps == 6
    assert json.dumps(record.to_json()) == json.dumps(ladder)  # the same bytes, key order included
    assert list(record.summary()) == ["schema", "verdict", "culprit", "replay", "runs", "report", "cost"]


def test_a_ladder_from_before_notes_and_costs_still_reads(runs: tuple[Path, Path], tmp_path: Path) -> None:
    ladder = _ladder(runs)  # same schema: notes, cost and stage starts came later
    for key in ("notes", "cost"):
        ladder.pop(key)
    for stage in ladder["stages"]:
        stage.pop("start")
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    record = load_ladder(tmp_path)
    assert record.cost is None and record.notes == () and [s.start for s in record.stages] == [0, 0]
    assert "Narrowing path" in write_report(tmp_path).read_text()


@pytest.mark.parametrize(
    "spoil,message",
    [
        (lambda d: d.update(verdict="maybe"), "field 'verdict' must be one of deterministic, nondeterministic"),
        (lambda d: d["stages"][1].pop("steps"), "(stages[1]) is malformed: field 'steps' is missing"),
        (lambda d: d["culprit"].update(origin="yes"), "(field 'culprit') is malformed: field 'origin' must be true"),
        (lambda d: d["culprit_records"][0].update(shape="8x4"), "field 'shape' must be a list of sizes"),
        (lambda d: d["cost"].update(resume="maybe"), "(field 'cost') is malformed: field 'resume' must be one of"),
        (lambda d: d["replay"].update(arms=[{**d["replay"]["base"], "distinct": "5"}]),
         "(arms[0]) is malformed: field 'distinct' must be an integer"),
        (lambda d: d.update(stages={}), "field 'stages' must be a list of stages"),
    ],
)
def test_malformed_ladder_is_one_sentence(runs: tuple[Path, Path], tmp_path: Path, spoil,  # type: ignore[no-untyped-def]
                                          message: str, capsys: pytest.CaptureFixture[str]) -> None:
    ladder = _ladder(runs)
    spoil(ladder)
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(tmp_path / LADDER_FILE) in err and "Traceback" not in err and err.count("\n") == 1


def test_piped_output_is_never_wrapped_or_cut() -> None:
    from rich.table import Table

    from detrace.report.terminal import make_console

    sink = io.StringIO()
    name = "inductor.cpp_fused_index_put_new_zeros_" + "x" * 150
    table = Table("name", "step", box=None)
    table.add_row(name, "3")
    make_console(sink).print(table)
    make_console(sink).print("word " * 40)
    lines = sink.getvalue().splitlines()
    assert any(name in line for line in lines) and ("word " * 40).strip() in [line.strip() for line in lines]


def test_code_outside_every_named_module_has_one_name_everywhere(runs: tuple[Path, Path], tmp_path: Path) -> None:
    from detrace.analyze.diff_result import TOP_LEVEL
    from detrace.cli.locate import render
    from detrace.report.terminal import make_console

    ladder = _ladder(runs)
    ladder["culprit"]["module"] = ""  # an op in the root model's own forward
    ladder["stages"][1]["found"] = ladder["culprit"]
    (tmp_path / LADDER_FILE).write_text(json.dumps(ladder))
    html = write_report(tmp_path).read_text()
    sink = io.StringIO()
    render(load_ladder(tmp_path), make_console(sink))
    assert f"module {TOP_LEVEL}" in sink.getvalue() and f'<td class="any">{TOP_LEVEL}</td>' in html
    assert f"<b>{TOP_LEVEL}</b>" in html and "(no module)" not in html


def test_an_all_equal_difference_chart_labels_no_decade() -> None:
    from detrace.report.svg import line_chart

    chart = line_chart("|A − B| of loss", [("|A − B|", {0: 0.0, 1: 0.0}, "#c62828", False)],
                       marks=[(1, "trace parts", "#000")], log=True)
    assert "1e" not in chart and "0 (equal)" in chart
    assert chart.rindex("trace parts</text>") > chart.rindex("<circle")  # the label is drawn over the points
