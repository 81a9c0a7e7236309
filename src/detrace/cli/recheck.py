"""`detrace recheck RUN --step K [--checkpoint DIR] [--out DIR] [--timeout S] [--json]`: re-execute step K of a
deterministic run on the same and on other devices, and tell a transient fault from a persistent one or from
software nondeterminism (see detrace/recheck.py). Exit 0 clean, 1 a fault or nondeterminism, 2 an inexact resume
(no answer about the devices) or an error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds
from detrace.defects.recheck import recheck
from detrace.tracefile.layout import default_out
from detrace.verdicts import RECHECK


def main(argv: list[str]) -> int:
    parser = ArgumentParser("recheck", "Re-execute one step of a deterministic run on the same and on other "
                            "devices: transient fault, persistent fault, software nondeterminism, or an inexact "
                            "resume. "
                            "Exit 0 clean, 1 a fault or nondeterminism, 2 an inexact resume or an error.")
    parser.add_argument("run", type=Path, help="the run's trace directory (semantic rung over step K)")
    parser.add_argument("--step", type=int, required=True, help="the global step to re-execute")
    parser.add_argument("--checkpoint", type=Path, help="the run's checkpoint at or before step K (default: make "
                        "one by running the command up to step K)")
    parser.add_argument("--out", type=Path,
                        help="directory for the re-executions (default: detrace-runs/recheck-<time>)")
    parser.add_argument("--timeout", type=seconds, help="seconds each re-execution may take before it is killed")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON (detrace.recheck/1)")
    args = parser.parse_args(argv)
    result = recheck(args.run, step=args.step, out=args.out or default_out("recheck"), checkpoint=args.checkpoint,
                     timeout=args.timeout,
                     progress=lambda line: print(f"detrace recheck: {line}", file=sys.stderr))
    print(json.dumps(result.to_json()) if args.json else result.sentence())
    return RECHECK[result.verdict]
