"""`detrace diff` on the command line: exit codes, --json, --rank, the human summary, and every refusal as one
sentence without a traceback."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from _synthetic import Fault, SyntheticRun, write_run

from detrace.analyze import diff
from detrace.cli import main
from detrace.report.terminal import render_diff
from detrace.tracefile import ARROW_SCHEMA, rank_path
from detrace.tracefile.lock import writing

RUN = SyntheticRun(ranks=2, steps=3, ops=4)


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(A, B identical to A, C with an injected fault on rank 1 at step 1)."""
    for name, fault in (("a", None), ("b", None), ("c", Fault(rank=1, step=1, op=2))):
        write_run(tmp_path / name, RUN, fault)
    return tmp_path / "a", tmp_path / "b", tmp_path / "c"


def one_error_line(err: str, command: str = "diff") -> str:
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith(f"detrace {command}: error: ")
    return err


def test_identical_exits_0(runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b, _ = runs
    assert main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.startswith(f"identical: 2 ranks, {2 * RUN.records_per_rank:,} records")


def test_diverged_exits_1_with_a_plain_summary(runs: tuple[Path, Path, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, _, c = runs
    assert main(["diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # piped: no escape codes
    lines = out.splitlines()
    assert lines[0] == f"diverged: 2 of 2 ranks differ ({2 * RUN.records_per_rank:,} records compared)"
    assert lines[1] == ("first divergence: rank 1, step 1, backward in layers.2: aten.mm.default "
                        "(output[0], call #0) [numeric]")
    assert "origin: its inputs were equal and its output differs" in out
    assert "origin ranks: 1" in out
    assert any("receiver" in line and "all_reduce#1 group 0,1" in line for line in lines)


def test_json_is_one_object_of_the_schema(runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, _, c = runs
    assert main(["diff", str(a), str(c), "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload == diff(a, c).to_json()
    assert payload["verdict"] == "diverged" and payload["origin_ranks"] == [1]
    assert payload["ranks"][0] == {"rank": 0, "first": payload["ranks"][0]["first"], "cause": "receiver",
                                   "via": "all_reduce#1 group 0,1"}


def test_rank_option(runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, _, c = runs
    assert main(["diff", str(a), str(c), "--rank", "1", "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in payload["ranks"]] == [1] and payload["compared"]["ranks"] == 1
    assert main(["diff", str(a), str(c), "--rank", "5"]) == 2
    assert "rank 5 has no trace" in one_error_line(capsys.readouterr().err)


def test_rich_summary_on_a_terminal(runs: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    a, _, c = runs
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the stream as a terminal
    monkeypatch.delenv("NO_COLOR", raising=False)
    stream = io.StringIO()
    render_diff(diff(a, c), file=stream)
    out = stream.getvalue()
    assert "\x1b[" in out and "aten.mm.default" in out and "all_reduce#1 group 0,1" in out


def test_incomparable_exits_2_with_the_reason(runs: tuple[Path, Path, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    a, b, _ = runs
    (b / "run.json").write_text('{"world_size": 4}')
    assert main(["diff", str(a), str(b)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert err.strip().endswith(f"{a} has world size 2 and {b} has world size 4.")
    assert main(["diff", str(a), str(b), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "incomparable"
    one_error_line(captured.err)


def test_other_schema_version_exits_2_naming_it(runs: tuple[Path, Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, _, _ = runs
    old = tmp_path / "old"
    old.mkdir()
    schema = ARROW_SCHEMA.with_metadata({"detrace.schema": "detrace.trace/0", "detrace.header": "{}"})
    with pa.ipc.new_file(str(rank_path(old, 0)), schema) as writer:
        writer.write_table(schema.empty_table())
    assert main(["diff", str(a), str(old)]) == 2
    assert "in trace format detrace.trace/0" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("case", ["missing", "empty", "file", "garbage"])
def test_unreadable_directories_exit_2_naming_the_path(runs: tuple[Path, Path, Path], tmp_path: Path, case: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    a, _, _ = runs
    bad = tmp_path / case
    if case == "empty":
        bad.mkdir()
    elif case == "file":
        bad.write_text("not a directory")
    elif case == "garbage":
        bad.mkdir()
        rank_path(bad, 0).write_bytes(b"garbage, not arrow")
    assert main(["diff", str(a), str(bad)]) == 2
    assert str(bad) in one_error_line(capsys.readouterr().err)


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "only-one"]) == 2
    one_error_line(capsys.readouterr().err)
    assert main(["diff", "a", "b", "--rank", "x"]) == 2
    one_error_line(capsys.readouterr().err)


def test_console_script_end_to_end(runs: tuple[Path, Path, Path]) -> None:
    a, _, c = runs
    done = subprocess.run([sys.executable, "-m", "detrace", "diff", str(a), str(c)], capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 1 and done.stdout.startswith("diverged:") and not done.stderr


def test_a_trace_still_being_written_is_said_to_be_running(runs: tuple[Path, Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    a, b, _ = runs
    (b / "run.json").write_text(json.dumps({"command": ["python", "t.py"], "status": "running"}))
    with writing(b):  # the lock a live `detrace run` holds on its directory
        assert main(["diff", str(a), str(b)]) == 0
        assert f"{b} is still running (its run.json says so)" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0  # its writer gone, the lock free: a writer that died
    out = capsys.readouterr().out
    assert "the detrace run that wrote it died (no detrace run holds its lock)" in out and "still running" not in out
    assert main(["diff", str(a), str(a)]) == 0
    assert "still running" not in capsys.readouterr().out
