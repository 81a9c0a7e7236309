"""`detrace audit [--json] [--steps N] [--out DIR] [--timeout S] [--force] -- CMD...`: run CMD once and report
every determinism hazard it shows, each with its place (rank, step, phase, module, op or kernel) and its fix.

Without CMD it audits this process's settings: what `detrace doctor` checks, in the audit's form.
Exit 0 when no certain hazard, 1 when there is one, 2 on error. `--json` prints the `detrace.audit/1` report.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.investigate.audit.report import Launch, audit_command, exit_code, render, settings_report
from detrace.launch.launcher import run_traced


def _parser() -> ArgumentParser:
    parser = ArgumentParser("audit", "Run CMD once and report every determinism hazard it shows, with its place "
                            "and its fix (certain ones exit 1). Without CMD: this environment's settings.",
                            usage="detrace audit [options] [-- CMD...]")
    parser.add_argument("--steps", type=int, default=2, metavar="N",
                        help="how many steps to audit from the first (default 2); CMD still runs to its end")
    parser.add_argument("--out", type=Path, help="run directory (default: detrace-runs/audit-YYYYmmdd-HHMMSS)")
    parser.add_argument("--timeout", type=seconds, metavar="SECONDS", help="kill CMD after this many seconds")
    parser.add_argument("--force", action="store_true", help="replace a trace already in the run directory")
    parser.add_argument("--json", action="store_true", help="print the detrace.audit/1 report as JSON")
    return parser


def main(argv: list[str], *, launch: Launch = run_traced) -> int:
    options, command = split_command(argv)
    args = _parser().parse_args(options)
    if command:
        out = args.out or Path(time.strftime("detrace-runs/audit-%Y%m%d-%H%M%S"))
        report = audit_command(command, out=out, steps=args.steps, timeout=args.timeout, force=args.force,
                               quiet=args.json, launch=launch)
    else:
        report = settings_report()
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render(report, sys.stdout)
    return exit_code(report)
