"""The CLI dispatcher: help, unknown commands, and errors mapped to exit codes without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from detrace.cli import COMMANDS, main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_arguments_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: detrace COMMAND" in capsys.readouterr().out


def test_unknown_command_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'frobnicate'" in err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"detrace {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_bad_option_is_a_usage_error_not_a_traceback(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"detrace {name}: error:")


def test_python_dash_m_and_version() -> None:
    done = subprocess.run([sys.executable, "-m", "detrace", "--version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert done.stdout.startswith("detrace ")


def _into_closed_pipe(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m detrace ARGV` with stdout a pipe whose reader has already gone (as `| head -c 1` ends)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "detrace", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    finally:
        os.close(write)


def test_a_closed_pipe_stops_quietly_and_keeps_the_verdict(tmp_path: Path) -> None:
    """F2: `detrace diff A A2 --json | head -c 1` and `detrace --help | head -1`."""
    from _synthetic import SyntheticRun, write_run

    run = SyntheticRun(ranks=1, steps=2, ops=2)
    write_run(tmp_path / "a", run)
    write_run(tmp_path / "a2", run)
    for argv, code in ((["diff", str(tmp_path / "a"), str(tmp_path / "a2"), "--json"], 0),
                       (["diff", str(tmp_path / "a"), str(tmp_path / "a2")], 0), (["--help"], 0),
                       (["certify", str(tmp_path / "a")], 0), (["diff", "--help"], 0)):
        done = _into_closed_pipe(*argv)
        assert (done.returncode, done.stderr) == (code, ""), argv


@pytest.mark.parametrize("name", ["run", "diff", "certify", "check", "check-resume", "locate", "report", "replay"])
def test_commands_that_orchestrate_or_read_start_without_torch(name: str) -> None:
    # torch costs about 3 s to import: the launchers (run, check, check-resume, locate) and the readers of
    # traces (diff, certify, report, replay's arguments) do not pay it before they need it.
    code = (f"import sys\nfrom detrace.cli import main\ntry:\n    main([{name!r}, '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr
