"""`detrace locate`: from "two runs of CMD differ" to "this op, this step, this rank", without touching CMD.

`locate` runs CMD under the zero-edit tracer (`detrace.launch.launcher.run_traced`) a bounded number of times,
each run narrower than the last, and compares pairs of runs with `detrace.diff`:

    rung 1  semantic (metrics + collectives + optimizer), every step, every rank    2 runs
            identical: "deterministic over N steps"; else the earliest divergent step and the origin ranks
    rung 2  module, only that step, only those ranks                                  2 runs
    rung 3  op, only that step, only those ranks: the first op with equal inputs
            and different outputs (the culprit)                                       2 runs
    rung 4  capture of the culprit's call (that op only, that step, that rank),
            then `detrace.investigate.replay` on it: is the op itself nondeterministic, and what fixes it    1 run

That is 7 runs. A narrow run records every rung in steps 0..S. Nondeterminism is random, so a narrower pair
may part earlier than S (caught in detail all the same; the stage moves to that step), not part by S (run once
more, recording every step), or, at the op rung, show no origin op (run once more). A first pair that is
identical gets a third run, and each narrow rung retries at most once, so the ladder costs at most 12 runs;
a rung that still does not settle
makes the verdict "inconclusive", with what the broader rungs established. Every run starts from the same
state (a fresh process of the same command, environment and working directory), and every run directory is
kept under `out`.

The checkpointed ladder, for a CMD that follows the resume contract (`detrace.TrainState`, docs/resume.md): the
broad runs save a checkpoint every K steps (DETRACE_CKPT_EVERY); one run resumed from a checkpoint of run A must
reproduce A's trace over the next window (the proof); then every narrower run resumes from A's latest checkpoint
at or before the divergent step and stops right after it (DETRACE_RESUME_FROM, DETRACE_STOP_AT), so it executes
at most K + 1 steps wherever the divergence lies. A proof that fails makes the narrow runs full runs again; a
CMD that writes no checkpoint gets today's full runs.

Modules: `config` (LocateConfig, the run budget, the embedded default command), `driver` (the rungs, run by run),
`stages` (the driver's records while it runs: stages, runs, progress), `evidence` (what the driver reads back
from its runs). The result is a `detrace.analyze.locate_result.LocateResult`, written as
ladder.json and locate.json and drawn by `detrace.report.html`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from detrace.analyze.locate_result import LADDER_FILE, LOCATE_FILE, LocateResult
from detrace.investigate.locate.config import (
    BASE_RUNS,
    DEFAULT_CHECKPOINT_EVERY,
    MAX_RUNS,
    LocateConfig,
    default_command,
)
from detrace.investigate.locate.driver import Ladder
from detrace.investigate.locate.stages import Progress, RunFailed
from detrace.launch.launcher import Launcher
from detrace.report.html import write_report
from detrace.tracefile import layout, write_json_atomic
from detrace.tracefile.layout import REPORT_FILE, prepare_out

__all__ = [
    "BASE_RUNS",
    "DEFAULT_CHECKPOINT_EVERY",
    "MAX_RUNS",
    "LocateConfig",
    "LocateResult",
    "Progress",
    "RunFailed",
    "default_command",
    "default_out",
    "locate",
]


def default_out(base: Path | None = None) -> Path:
    """A fresh `detrace-runs/locate-<timestamp>` directory under `base` (the working directory by default)."""
    return layout.default_out("locate", base)


def locate(config: LocateConfig, progress: Progress | None = None, *, force: bool = False,
           launch: Launcher | None = None) -> LocateResult:
    """Drive the ladder on `config.command`; write locate.json, ladder.json and report.html into `config.out`.

    Raises `RunFailed` (a `CommandFailed`) when CMD crashes or hangs in any run, `TraceError` when its traces
    cannot be compared. Runs already made stay in `config.out`.
    """
    config = dataclasses.replace(config, out=config.out.resolve())
    prepare_out(config.out, holds="runs", force=force, name="--out")
    result = Ladder(config, progress, launch=launch).run(report=str(config.out / REPORT_FILE))
    write_json_atomic(config.out / LADDER_FILE, result.to_json())
    write_report(config.out, Path(result.report))
    write_json_atomic(config.out / LOCATE_FILE, result.summary())
    return result
