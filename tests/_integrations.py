"""Helpers shared by the framework integrations' tests: run an example script, run `detrace check-resume` on it,
and sort the final parameters it reports by the contract variables each run had."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from detrace.cli import main


def arms(report: Path) -> dict[str, set[str]]:
    """The final parameters of each kind of run in a --report file, by the contract variables it ran under."""
    found: dict[str, set[str]] = {"continuous": set(), "stopped": set(), "resumed": set(), "control": set()}
    for line in report.read_text().splitlines():
        run = json.loads(line)
        kind = ("control" if run["DETRACE_RESUME_CONTROL"] else "resumed" if run["DETRACE_RESUME"] == "1"
                else "stopped" if run["DETRACE_STOP_AT"] else "continuous")
        found[kind].add(run["params"])
    return found


def run_example(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)


def check_resume(script: Path, out: Path, *, at: int) -> tuple[int, Path, dict[str, set[str]]]:
    """`detrace check-resume --at AT` on the example with 2 DataLoader workers: exit code, runs, arms."""
    report = out.parent / "report.jsonl"
    code = main(["check-resume", "--at", str(at), "--out", str(out), "--", sys.executable, str(script),
                 "--workers", "2", "--report", str(report)])
    return code, out, arms(report)
