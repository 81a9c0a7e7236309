"""Helpers shared by the framework integrations' tests: run an example script (under torchrun too), resume it from
its periodic checkpoints, and sort the final parameters it reports by the contract variables each run had."""

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


def periodic_checkpoints_resume_exactly(script: Path, tmp_path: Path, *, workers: int, traced: Path,
                                        extra: tuple[str, ...] = ()) -> tuple[dict[int, Path], str]:
    """What `detrace locate` asks of a script: traced (`detrace run`, into `traced`) with DETRACE_CKPT_EVERY=2, it
    keeps a checkpoint after steps 2, 4 and 6 (listed by `saved_versions`) and trains to its end (the continuous
    run); resumed from the one after step 2 (DETRACE_RESUME_FROM) in a fresh process, it ends with the continuous
    run's bits. `workers`: DataLoader workers; `extra`: further arguments of the script. The checkpoints by step, and
    the continuous run's final parameters."""
    report = tmp_path / "report.jsonl"
    options = ("--workers", str(workers), "--report", str(report), *extra)
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("DETRACE_CKPT_DIR", str(tmp_path / "a"))
        environment.setenv("DETRACE_CKPT_EVERY", "2")
        assert main(["run", "--out", str(traced), "--", sys.executable, str(script), *options]) == 0
    versions = saved_versions(tmp_path / "a")
    assert sorted(versions) == [2, 4, 6], versions
    resumed = run_example(script, *options,
                          env={"DETRACE_CKPT_DIR": str(tmp_path / "b"), "DETRACE_RESUME_FROM": str(versions[2])})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    found = arms(report)
    assert len(found["continuous"]) == 1 and found["resumed"] == found["continuous"], found
    return versions, next(iter(found["continuous"]))
