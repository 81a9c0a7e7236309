"""`detrace locate`: bad input, broken commands, deterministic commands, and an honest "inconclusive".

The end-to-end ladders on real nondeterminism are in test_locate_e2e.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _scenarios import GATHER
from _tools import locate_cli

from detrace.analyze.locate_result import LOCATE_FILE, load_ladder
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


def test_default_command_is_the_index_dispatch_on_two_threads() -> None:
    command = default_command()
    assert command[:3] == [sys.executable, "-m", "detrace.workload.train"]
    assert command[command.index("--dispatch") + 1] == "index"
    assert command[command.index("--threads") + 1] == "2"


def test_default_out_is_fresh(tmp_path: Path) -> None:
    first = default_out(tmp_path)
    first.mkdir(parents=True)
    second = default_out(tmp_path)
    assert first.parent == tmp_path / "detrace-runs" and first.name.startswith("locate-")
    assert second != first and not second.exists()


def test_command_not_installed(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--", "detrace-no-such-command-xyz", "--flag")
    assert done.returncode == 2
    assert "command not found: detrace-no-such-command-xyz" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_command_failing_on_its_first_run_shows_its_output(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--", sys.executable, "-c",
                      "import sys; print('boom: no data at /nowhere', file=sys.stderr); sys.exit(3)")
    assert done.returncode == 2
    assert "CMD exited with status 3 in run 1-semantic-a" in done.stderr
    assert "boom: no data at /nowhere" in done.stderr  # the tail of CMD's own output
    assert "Traceback" not in done.stderr
    # the failed run is kept for inspection
    assert (tmp_path / "out" / "1-semantic-a" / "run.json").exists()


def test_hanging_command_ends_at_the_timeout(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--timeout", "3", "--", sys.executable, "-c",
                      "import time; time.sleep(60)", timeout=60)
    assert done.returncode == 2
    assert "run 1-semantic-a of the ladder failed" in done.stderr and "timeout of 3 seconds" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--timeout", "-1", "--", "true"], "--timeout must be a positive number"),
        (["--timeout", "soon", "--", "true"], "invalid float value"),
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


@pytest.fixture(scope="module")
def deterministic(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    folder = tmp_path_factory.mktemp("locate-deterministic")
    out = folder / "out"
    # The human form on stdout; the JSON object is the locate.json the ladder writes (the same object `--json`
    # prints: test_locate_e2e checks that on its culprit ladder).
    done = locate_cli("--out", str(out), "--", sys.executable, str(GATHER), "2", "--deterministic", "--small")
    return done, out


def test_deterministic_command_exits_0_with_the_verdict(
        deterministic: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = deterministic
    assert done.returncode == 0, done.stderr
    payload = json.loads((out / LOCATE_FILE).read_text())
    assert sorted(payload) == ["cost", "culprit", "replay", "report", "runs", "schema", "verdict"]
    assert payload["schema"] == "detrace.locate/1" and payload["verdict"] == "deterministic"
    assert payload["culprit"] is None and payload["replay"] is None
    assert payload["runs"] == [str(out / name) for name in ("1-semantic-a", "1-semantic-b", "1-semantic-c")]
    assert all(Path(run, "rank-00000.arrow").exists() for run in payload["runs"])
    assert Path(payload["report"]).exists()
    ladder = load_ladder(out)
    assert "over 2 steps" in ladder.stages[0].note
    assert "rung 1 (metrics + semantic) the three runs are bit-identical over 2 steps" in " ".join(
        done.stderr.split())


def test_deterministic_human_summary(deterministic: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, _ = deterministic
    assert done.stdout.startswith("deterministic over 2 steps:"), done.stdout
    assert "runs     3 (of at most 14)" in done.stdout
