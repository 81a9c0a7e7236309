"""Helpers shared by the framework integrations' tests: run an example script, run `detrace check-resume` on it,
and sort the final parameters it reports by the contract variables each run had."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detrace.cli import main
from detrace.state.contract import saved_versions


def arms(report: Path) -> dict[str, set[str]]:
    """The final parameters of each kind of run in a --report file, by the contract variables it ran under."""
    found: dict[str, set[str]] = {"continuous": set(), "stopped": set(), "resumed": set(), "control": set()}
    for line in report.read_text().splitlines():
        run = json.loads(line)
        resumed = run["DETRACE_RESUME"] == "1" or run.get("DETRACE_RESUME_FROM")
        kind = ("control" if run["DETRACE_RESUME_CONTROL"] else "resumed" if resumed
                else "stopped" if run["DETRACE_STOP_AT"] else "continuous")
        found[kind].add(run["params"])
    return found


def run_example(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)


def torchrun_example(script: Path, *args: str, env: dict[str, str]) -> None:
    """Run the example under torchrun at 2 ranks (gloo on CPU); it must succeed."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def check_resume(script: Path, out: Path, *, at: int, extra: tuple[str, ...] = ()
                 ) -> tuple[int, Path, dict[str, set[str]]]:
    """`detrace check-resume --at AT` on the example with 2 DataLoader workers (and `extra` arguments): exit code,
    runs, arms."""
    report = out.parent / "report.jsonl"
    code = main(["check-resume", "--at", str(at), "--out", str(out), "--", sys.executable, str(script),
                 "--workers", "2", "--report", str(report), *extra])
    return code, out, arms(report)


def periodic_checkpoints_resume_exactly(script: Path, tmp_path: Path, *, continuous: set[str],
                                        traced: Path | None = None, extra: tuple[str, ...] = ()) -> dict[int, Path]:
    """What `detrace locate` asks of a script: with DETRACE_CKPT_EVERY=2 it keeps a checkpoint after steps 2, 4
    and 6 (listed by `saved_versions`) and ends as the continuous run does; resumed from the one after step 2
    (DETRACE_RESUME_FROM) in a fresh process, it ends with the continuous run's bits too. With `traced`, the saving
    run is traced there (`detrace run`); `extra`: further arguments of the script."""
    report = tmp_path / "report.jsonl"
    options = ("--workers", "0", "--report", str(report), *extra)
    periodic = {"DETRACE_CKPT_DIR": str(tmp_path / "a"), "DETRACE_CKPT_EVERY": "2"}
    if traced is None:
        saving = run_example(script, *options, env=periodic)
        assert saving.returncode == 0, saving.stderr[-2000:]
    else:
        with pytest.MonkeyPatch.context() as environment:
            for name, value in periodic.items():
                environment.setenv(name, value)
            assert main(["run", "--out", str(traced), "--", sys.executable, str(script), *options]) == 0
    versions = saved_versions(tmp_path / "a")
    assert sorted(versions) == [2, 4, 6], versions
    resumed = run_example(script, *options,
                          env={"DETRACE_CKPT_DIR": str(tmp_path / "b"), "DETRACE_RESUME_FROM": str(versions[2])})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    found = arms(report)
    assert found["continuous"] == continuous and found["resumed"] == continuous, found
    return versions
