"""`detrace certify RUN [--expected-ranks SPEC] [--expected-steps SPEC]`: check a trace's invariants.

Exit codes: 0 every invariant holds, 1 violations (listed), 2 unreadable run directory or bad SPEC.
"""

from __future__ import annotations

from detrace.analyze import certify
from detrace.cli._args import ArgumentParser
from detrace.report.terminal import render_certify
from detrace.verdicts import CERTIFY


def main(argv: list[str]) -> int:
    parser = ArgumentParser("certify", "Check that a run directory holds every expected rank and step, with dense "
                            "sequence numbers and no collective left incomplete at the end of a window.")
    parser.add_argument("run", metavar="RUN", help="run directory")
    parser.add_argument("--expected-ranks", metavar="SPEC",
                        help="ranks that must be present (default: the rank window the run was recorded with)")
    parser.add_argument("--expected-steps", metavar="SPEC",
                        help="steps that must be present on every rank (default: the recorded step window, "
                             "up to the last step)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes checking ranks in parallel (default: every core, for large runs)")
    args = parser.parse_args(argv)
    result = certify(args.run, expected_ranks=args.expected_ranks, expected_steps=args.expected_steps,
                     workers=args.workers)
    render_certify(result)
    return CERTIFY["certified" if result.ok else "violations"]
