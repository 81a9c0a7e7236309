"""`detrace check [--runs N] [--out DIR] [--timeout S] [--json] -- CMD...`: N runs from the same state must be
bit-identical at the metrics and semantic rungs. Exit 0 identical, 1 diverged, 2 error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.investigate.check import check
from detrace.report.meaning import apart_notes, locate_next, warned
from detrace.report.terminal import render_diff
from detrace.tracefile.layout import default_out


def main(argv: list[str]) -> int:
    options, cmd = split_command(argv)
    parser = ArgumentParser("check", "Run CMD N times from the same state and require bit-identical traces. "
                            "Exit codes: 0 identical, 1 diverged, 2 error.", usage="detrace check [options] -- CMD...")
    parser.add_argument("--runs", type=int, default=2, help="how many runs (default 2)")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: detrace-runs/check-<time>)")
    parser.add_argument("--timeout", type=seconds, help="seconds each run may take before it is killed")
    parser.add_argument("--json", action="store_true", help="print the diffs as JSON on stdout")
    args = parser.parse_args(options)
    result = check(cmd, runs=args.runs, out=args.out or default_out("check"), timeout=args.timeout,
                   progress=lambda line: print(f"detrace check: {line}", file=sys.stderr))
    if args.json:
        print(json.dumps({"schema": "detrace.check/1", "identical": result.identical,
                          "runs": [str(p) for p in result.runs], "diffs": [d.to_json() for d in result.diffs]}))
    elif result.identical:
        print(f"identical: {len(result.runs)} runs are bit-identical ({result.runs[0].parent})")
        for note in apart_notes(result.diffs[0]):
            print(f"note: {note}")
        for line in warned(*result.runs):  # records that could not be made: the runs agree on what was recorded
            print(f"note: {line}")
    else:
        bad = result.first_divergent
        assert bad is not None
        print(f"run {result.diffs.index(bad) + 2} differs from run 1 ({result.runs[0].parent}):")
        render_diff(bad)
        for line in warned(bad.a, bad.b):
            print(line)
        print(locate_next(cmd))
    return result.exit_code
