"""`detrace locate`: its configuration, bad input, and broken or hanging commands (real commands, the CLI in
process).

The ladder's verdicts (deterministic included), narrowing and messages are checked in process on synthetic traces
in tests/unit/test_locate_logic.py; the end-to-end ladders on real nondeterminism are in
tests/e2e/test_locate_e2e.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.analyze.locate_result import load_ladder
from detrace.cli import main
from detrace.errors import TraceError, UsageError
from detrace.investigate.locate import BASE_RUNS, MAX_RUNS, LocateConfig, default_command, default_out


def test_config_checks() -> None:
    with pytest.raises(UsageError, match="needs a command"):
        LocateConfig(command=(), out=Path("x"))
    with pytest.raises(UsageError, match="--timeout"):
        LocateConfig(command=("true",), out=Path("x"), timeout=0)
    with pytest.raises(UsageError, match="at most once"):
        LocateConfig(command=("true",), out=Path("x"), retries=2)


def test_run_budget_is_stated() -> None:
    assert (BASE_RUNS, MAX_RUNS) == (7, 14)


def test_default_command_is_the_index_dispatch_on_more_threads_than_a_small_machines_cores() -> None:
    command = default_command()
    assert command[:3] == [sys.executable, "-m", "detrace.workload.train"]
    assert command[command.index("--dispatch") + 1] == "index"
    assert command[command.index("--threads") + 1] == "8"  # the race strikes on a busy machine too


def test_default_out_is_fresh(tmp_path: Path) -> None:
    first = default_out(tmp_path)
    first.mkdir(parents=True)
    second = default_out(tmp_path)
    assert first.parent == tmp_path / "detrace-runs" and first.name.startswith("locate-")
    assert second != first and not second.exists()


def test_command_not_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["locate", "--out", str(tmp_path / "out"), "--", "detrace-no-such-command-xyz", "--flag"]) == 2
    printed = capsys.readouterr()
    assert "command not found: detrace-no-such-command-xyz" in printed.err
    assert "Traceback" not in printed.err and printed.out == ""


def test_command_failing_on_its_first_run_shows_its_output(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["locate", "--out", str(tmp_path / "out"), "--", sys.executable, "-c",
                 "import sys; print('boom: no data at /nowhere', file=sys.stderr); sys.exit(3)"])
    err = capsys.readouterr().err
    assert code == 2
    assert "CMD exited with status 3 in run 1-semantic-a" in err
    assert "boom: no data at /nowhere" in err  # the tail of CMD's own output
    assert "Traceback" not in err
    # the failed run is kept for inspection
    assert (tmp_path / "out" / "1-semantic-a" / "run.json").exists()


def test_hanging_command_ends_at_the_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["locate", "--out", str(tmp_path / "out"), "--timeout", "3", "--", sys.executable, "-c",
                 "import time; time.sleep(60)"])
    err = capsys.readouterr().err
    assert code == 2
    assert "run 1-semantic-a of the ladder failed" in err and "timeout of 3 seconds" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--timeout", "-1", "--", "true"], "'-1' is not a positive, finite number of seconds"),
        (["--timeout", "nan", "--", "true"], "'nan' is not a positive, finite number of seconds"),
        (["--timeout", "soon", "--", "true"], "'soon' is not a number of seconds"),
        (["--repeats", "1", "--", "true"], "at least 2 repeats"),
        (["python", "train.py"], "unrecognized arguments"),
    ],
)
def test_bad_options_are_one_sentence(tmp_path: Path, args: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["locate", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("detrace locate: error:")


def test_out_must_be_empty_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["locate", "--out", str(tmp_path), "--", "true"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_not_a_locate_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a locate directory"):
        load_ladder(tmp_path)


@pytest.mark.parametrize("args", [["--timeout", "-1", "--", "true"], ["--", "detrace-no-such-command-xyz"]])
def test_every_error_is_one_json_object_with_json(tmp_path: Path, args: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["locate", "--json", "--out", str(tmp_path / "out"), *args]) == 2
    printed = capsys.readouterr()
    payload = json.loads(printed.out)
    assert payload["verdict"] == "error" and payload["message"] and "Traceback" not in printed.err
    assert f"detrace locate: error: {payload['message']}" in printed.err
