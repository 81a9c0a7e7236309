"""The CLI as a process: `python -m detrace`, a stdout whose reader has gone, and what a command imports before it
needs it (the dispatcher in process: tests/unit/test_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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


COMMANDS_WITHOUT_TORCH = ("run", "diff", "certify", "check", "check-resume", "locate", "report", "replay")


def test_commands_that_orchestrate_or_read_start_without_torch() -> None:
    # torch costs about 3 s to import: the launchers (run, check, check-resume, locate) and the readers of
    # traces (diff, certify, report, replay's arguments) do not pay it before they need it. One process asks each
    # command in turn, and says which one first imported torch (none may).
    code = ("import sys\nfrom detrace.cli import main\n"
            f"for name in {COMMANDS_WITHOUT_TORCH!r}:\n"
            "    try:\n        main([name, '--help'])\n    except SystemExit:\n        pass\n"
            "    if 'torch' in sys.modules:\n        print('torch imported by', name, file=sys.stderr)\n        break\n"
            "else:\n    print('no command imported torch', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "no command imported torch", done.stderr
