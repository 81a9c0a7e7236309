"""`detrace run`: run CMD with the tracer injected into every Python process it starts; no edit of CMD.

    detrace run [--out DIR] [--rung metrics|semantic|module|op] [--steps SPEC] [--ranks SPEC] [--max-numel N]
                [--force] [--capture SELECTOR] [--timeout SECONDS] [--guard N[:warn]] -- CMD...

Exits with CMD's exit code; 128+N when CMD was killed by signal N (the shell's convention: SIGKILL -> 137).
"""

from __future__ import annotations

import sys
import time

from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.errors import UsageError
from detrace.launch.launcher import describe, run_traced
from detrace.record.config import parse_steps_option
from detrace.tracefile.schema import RUNGS


def _parser() -> ArgumentParser:
    parser = ArgumentParser("run", "Run CMD with the tracer injected into every Python process it starts "
                            "(python script.py, python -m module, torchrun ...). Exits with CMD's exit code.",
                            usage="detrace run [options] -- CMD...")
    parser.add_argument("--out", help="run directory to write (default: detrace-runs/run-YYYYmmdd-HHMMSS)")
    parser.add_argument("--rung", default="metrics", help=f"highest rung recorded: {' | '.join(RUNGS)} "
                        "(each includes the ones before it; default metrics)")
    parser.add_argument("--steps", action="append", default=[], metavar="SPEC",
                        help="steps to record: all, 3, 2-5, 0,3,8-15, ::10; RUNG=SPEC sets one rung's window "
                        "(repeatable, e.g. --steps op=3)")
    parser.add_argument("--ranks", default="all", metavar="SPEC", help="ranks to record (default all)")
    parser.add_argument("--max-numel", type=int, metavar="N",
                        help="tensors with more elements get no digest (shape, dtype, numel still recorded)")
    parser.add_argument("--force", action="store_true", help="replace a trace already in the run directory")
    parser.add_argument("--capture", metavar="SELECTOR",
                        help="kernel rung: save one op call for replay, e.g. step=3,rank=1,phase=backward,"
                        "name=aten.index_put_.default,occurrence=0 (needs --rung op)")
    parser.add_argument("--timeout", type=seconds, metavar="SECONDS", help="kill CMD after this many seconds")
    parser.add_argument("--guard", metavar="N[:warn]",
                        help="replica guard: compare every replicated tensor across ranks every N steps; exit 3 "
                        "on a mismatch (N:warn reports and goes on)")
    return parser


def main(argv: list[str]) -> int:
    options, command = split_command(argv)
    args = _parser().parse_args(options)
    if not command:
        raise UsageError("no command to run; give it after '--', e.g. detrace run -- python train.py")
    env = {}
    if args.guard is not None:
        # imported here: the guard needs torch, which the launcher itself does not (3 s saved per run)
        from detrace.defects.guard import ENV_GUARD, parse_env

        parse_env(args.guard)  # a bad value is refused here, before CMD starts
        env[ENV_GUARD] = args.guard
    out = args.out or time.strftime("detrace-runs/run-%Y%m%d-%H%M%S")
    result = run_traced(command, out, rung=args.rung, steps=parse_steps_option(args.steps), ranks=args.ranks,
                        max_numel=args.max_numel, capture=args.capture, force=args.force, timeout=args.timeout,
                        env=env, share_stdin=False,  # one run: CMD reads detrace's stdin as it comes
                        untraced_ok=True)  # the summary says when nothing was recorded, and why
    print(f"detrace run: {describe(result)}", file=sys.stderr)
    return 128 - result.returncode if result.returncode < 0 else result.returncode
