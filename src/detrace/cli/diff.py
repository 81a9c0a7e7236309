"""`detrace diff A B [--json] [--rank R] [--strict-command]`: compare two run directories on the global steps both
have and name the first divergent bit.

Exit codes: 0 identical, 1 diverged, 2 incomparable or unreadable (one sentence on stderr, never a traceback).
"""

from __future__ import annotations

import json

from detrace.analyze import diff
from detrace.cli._args import ArgumentParser
from detrace.errors import IncomparableError
from detrace.report.terminal import render_diff


def main(argv: list[str]) -> int:
    parser = ArgumentParser("diff", "Compare two run directories record by record: are they bit-identical, and "
                            "if not, where did the first bit diverge and how did it spread across ranks?")
    parser.add_argument("a", metavar="A", help="run directory of the first run")
    parser.add_argument("b", metavar="B", help="run directory of the second run")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema detrace.diff/1)")
    parser.add_argument("--rank", type=int, metavar="R", help="compare only rank R")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes aligning ranks in parallel (default: every core, for large runs)")
    parser.add_argument("--strict-command", action="store_true",
                        help="runs of different commands are incomparable (default: compared, and the summary says so)")
    args = parser.parse_args(argv)
    result = diff(args.a, args.b, rank=args.rank, workers=args.workers, strict_command=args.strict_command)
    if args.json:
        print(json.dumps(result.to_json()))
    if result.verdict == "incomparable":
        raise IncomparableError(result.reason or "the runs are not comparable")
    if not args.json:
        render_diff(result)
    return result.exit_code
