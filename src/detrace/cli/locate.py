"""`detrace locate [--json] [--out DIR] [--checkpoint-every K] [-- CMD...]`: drive the whole ladder, print progress
on stderr.

Exit 0 when the runs are deterministic, 1 when a culprit was found, 2 on error or an inconclusive ladder. With
`--json`, an error too is one JSON object on stdout (`"verdict": "error"` and the sentence).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from detrace.analyze.diff_result import scope_label
from detrace.analyze.locate_result import LOCATE_SCHEMA, LocateResult, Stage
from detrace.analyze.replay_result import ReplayConfig
from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.errors import CommandFailed, DetraceError
from detrace.investigate.locate import (
    BASE_RUNS,
    DEFAULT_CHECKPOINT_EVERY,
    MAX_RUNS,
    LocateConfig,
    default_command,
    default_out,
    locate,
)
from detrace.investigate.locate import Progress as LadderProgress
from detrace.report.terminal import make_console
from detrace.tracefile.layout import link_latest, remove_empty

if TYPE_CHECKING:
    from detrace.launch.launcher import Launcher

_RUNG_TITLES = {"semantic": "rung 1 (metrics + semantic)", "resume": "resume proof", "module": "rung 2 (module)",
                "op": "rung 3 (op)", "kernel": "rung 4 (kernel)"}


class RichProgress(LadderProgress):
    """A progress bar over the ladder's runs and one line per rung, on stderr."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=True)
        self.task = self.bar.add_task("starting", total=BASE_RUNS)

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def run_started(self, name: str, planned: int) -> None:
        self.bar.update(self.task, description=f"run {name}", total=planned)

    def run_finished(self, name: str, elapsed: float) -> None:
        self.bar.advance(self.task)

    def rung(self, stage: Stage) -> None:
        self.console.print(f"[bold]{_RUNG_TITLES[stage.rung]}[/] {stage.note}", highlight=False)


def render(result: LocateResult, console: Console) -> None:
    """The terminal summary."""
    colour = {"deterministic": "green", "nondeterministic": "red"}.get(result.verdict, "yellow")
    span = f" over {result.steps} step{'s' * (result.steps != 1)}" if result.verdict == "deterministic" else ""
    console.print(f"[bold {colour}]{result.verdict}{span}[/]: {result.message}", highlight=False)
    if result.culprit and result.verdict == "nondeterministic":
        c = result.culprit
        console.print(f"  culprit  {c.name}  module {scope_label(c.module)}  phase {c.phase}  "
                      f"step {c.step}  rank {c.rank}  {'origin' if c.origin else 'receiver'}",
                      highlight=False)
    for record in result.culprit_records:
        state = "equal" if record.equal else "DIFFERS"
        console.print(f"    {record.role}[{record.index}] {record.dtype}{record.shape}: {state}", highlight=False)
    if result.replay is not None:
        r = result.replay
        console.print(f"  replay   {'nondeterministic' if r.nondeterministic else 'deterministic'} over "
                      f"{r.base.repeats} repeats; {r.base.differing_elements} elements differ, max "
                      f"{r.base.max_ulp} ULP; fixed by: {', '.join(r.fixed_by) or '-'}", highlight=False)
        for advice in r.advice:
            console.print(f"  advice   {advice}", highlight=False, markup=False)
    console.print(f"  runs     {len(result.runs)} (of at most {MAX_RUNS}), kept in {result.out}", highlight=False)
    cost = result.cost
    per_run = {run.run: run for run in cost.per_run} if cost else {}
    for run in result.runs:
        spent = per_run.get(Path(run).name)
        where = f"  (from step {spent.start}, {spent.steps} step{'s' * (spent.steps != 1)})" if spent else ""
        console.print(f"           {run}{where}", highlight=False)
    if cost:
        every = f", a checkpoint every {cost.checkpoint_every} steps" if cost.checkpoint_every else ""
        console.print(f"  cost     {cost.steps} steps executed in {len(cost.per_run)} runs, {cost.seconds:.1f} s"
                      f"{every} (resume: {cost.resume})", highlight=False)
    for note in result.notes:
        console.print(f"  note     {note}", highlight=False)
    console.print(f"  report   {result.report}", highlight=False)


def main(argv: list[str], *, launch: Launcher | None = None) -> int:
    """`launch`: the function that runs CMD (`run_traced` when None), the seam that tests script."""
    options, command = split_command(argv)
    try:
        return _locate(options, command, launch)
    except DetraceError as err:
        if "--json" not in options:
            raise
        # One JSON object on stdout, whatever went wrong: a caller parsing stdout never gets nothing.
        print(json.dumps({"schema": LOCATE_SCHEMA, "verdict": "error", "message": str(err)}, indent=1))
        print(f"detrace locate: error: {err}", file=sys.stderr)
        return err.exit_code


def _locate(options: list[str], command: list[str], launch: Launcher | None) -> int:
    parser = ArgumentParser(
        "locate",
        f"Find the first op that makes two runs of CMD differ, by the progressive ladder: {BASE_RUNS} runs of CMD "
        f"(at most {MAX_RUNS} when a narrower rerun does not reproduce the divergence). Without CMD, locate the "
        "reference workload's nondeterministic MoE dispatch. Exit 0 deterministic, 1 culprit found, 2 error or "
        "inconclusive.",
        epilog="usage with a command: detrace locate [options] -- CMD...")
    parser.add_argument("--json", action="store_true", help="print the detrace.locate/1 object on stdout")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for every run, the JSON results and report.html "
                             "(default: a new ./detrace-runs/locate-<timestamp>, linked from "
                             "./detrace-runs/locate-latest once it completes)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--timeout", type=seconds, default=LocateConfig.timeout, metavar="SECONDS",
                        help="seconds one run of CMD may take before it counts as hung (default %(default)s)")
    parser.add_argument("--max-numel", type=int, default=None, metavar="N",
                        help="at the module and op rungs, do not fingerprint tensors above N elements")
    parser.add_argument("--repeats", type=int, default=ReplayConfig().repeats,
                        help="least executions per arm of the kernel rung's replay (default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                        help="for a CMD that follows the resume contract (detrace.TrainState): the broad runs save "
                             f"a checkpoint every K steps (default {DEFAULT_CHECKPOINT_EVERY}) and the narrow runs "
                             "resume from the last one before the divergence")
    parser.add_argument("--no-checkpoints", action="store_true",
                        help="ask CMD for no checkpoint: every run is a full run")
    args = parser.parse_args(options)
    config = LocateConfig(command=tuple(command or default_command()), out=args.out or default_out(),
                          timeout=args.timeout, max_numel=args.max_numel, replay=ReplayConfig(repeats=args.repeats),
                          checkpoint_every=args.checkpoint_every, checkpoints=not args.no_checkpoints)
    console = make_console(stderr=True)
    console.print(f"detrace locate: {' '.join(config.command)}" + ("" if command else "  (embedded default)"))
    console.print(f"  {BASE_RUNS} runs (at most {MAX_RUNS}) into {config.out}")
    try:
        with RichProgress(console) as progress:
            result = locate(config, progress, force=args.force, launch=launch)
    except BaseException as err:
        tail = getattr(err, "output_tail", "") if isinstance(err, CommandFailed) else ""
        if tail:
            console.print("the end of CMD's output:", style="bold")
            console.print(tail.rstrip(), markup=False, highlight=False)
        if args.out is None:  # a default directory that a failure left empty does not pile up
            remove_empty(config.out)
        raise
    if args.out is None:
        link = link_latest(config.out, "locate")
        if link is not None:
            console.print(f"  latest   {os.path.relpath(link)}  (detrace report {os.path.relpath(link)})")
    if args.json:
        print(json.dumps(result.summary(), indent=1))
    else:
        render(result, make_console())
    return result.exit_code
