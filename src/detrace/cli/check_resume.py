"""`detrace check-resume --at K [--out DIR] [--timeout S] [--json] -- CMD...`: a run stopped after step K and
resumed in a fresh process must continue with exactly the bits of the run that never stopped; a negative
control (resume without the RNG states) must diverge, or the check proves nothing.
Exit 0 exact, 1 resume changed bits, 2 error or unproven."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser, split_command
from detrace.report.terminal import diff_lines, render_diff
from detrace.verify import NEGATIVE_CONTROL, check_resume, default_out


def main(argv: list[str]) -> int:
    options, cmd = split_command(argv)
    parser = ArgumentParser("check-resume", "Verify that stopping after step K and resuming changes no bit.")
    parser.add_argument("--at", type=int, required=True, help="stop after this many optimizer steps, then resume")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: detrace-resume-<time>)")
    parser.add_argument("--timeout", type=float, help="seconds each run may take before it is killed")
    parser.add_argument("--json", action="store_true", help="print the verdict and both diffs as JSON on stdout")
    args = parser.parse_args(options)
    result = check_resume(cmd, at=args.at, out=args.out or default_out("resume"), timeout=args.timeout,
                          progress=lambda line: print(f"detrace check-resume: {line}", file=sys.stderr))
    if args.json:
        print(json.dumps({"schema": "detrace.check-resume/1", "verdict": result.verdict, "at": result.at,
                          "runs": {name: str(getattr(result, name))
                                   for name in ("continuous", "stopped", "resumed", "control")},
                          "resume": result.resume_diff.to_json(), "control": result.control_diff.to_json()}))
    elif result.verdict == "exact":
        control = diff_lines(result.control_diff)[1:2] or ["(no detail)"]
        print(f"exact: resuming after step {args.at} changed no bit; the negative control ({NEGATIVE_CONTROL}) "
              f"diverged as it must, {control[0]}")
    elif result.verdict == "diverged":
        print(f"resuming after step {args.at} changed the run:")
        render_diff(result.resume_diff)
    else:
        print(f"unproven: the resumed run matched, but so did the negative control ({NEGATIVE_CONTROL}), so this "
              "check cannot tell a correct resume from a wrong one (does CMD use randomness after the resume step?)")
    return {"exact": 0, "diverged": 1}.get(result.verdict, 2)
