"""`detrace validate [--fast | --only NAMES] [--steps N] [--at K] [--out DIR] [--timeout S] [--list]`:
the validation matrix of the reference workload (see `detrace.investigate.validate`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds
from detrace.errors import DetraceError, UsageError
from detrace.investigate.validate import CONFIGS, FAST, table, validate
from detrace.verdicts import VALIDATE


def main(argv: Sequence[str]) -> int:
    parser = ArgumentParser("validate", "Run the validation matrix of the reference workload.")
    parser.add_argument("--only", help="comma-separated config names (see --list)")
    parser.add_argument("--fast", action="store_true", help=f"the CI subset: {', '.join(FAST)}")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (default 4)")
    parser.add_argument("--at", type=int, default=2, help="check-resume stops after this step (default 2)")
    parser.add_argument("--out", type=Path, default=Path("detrace-validate"), help="where the runs go")
    parser.add_argument("--timeout", type=seconds, default=300.0, help="seconds one training run may take")
    try:
        args = parser.parse_args(list(argv))
        if args.list:
            for cfg in CONFIGS:
                print(f"{cfg.name:<18} {' '.join(cfg.command(steps=args.steps, deterministic=True)[1:])}")
            return 0
        if not 1 <= args.at < args.steps:
            raise UsageError(f"--at {args.at} must be a step before the last (--steps {args.steps})")
        names = FAST if args.fast else (tuple(n.strip() for n in args.only.split(",")) if args.only else None)
        known = {cfg.name: cfg for cfg in CONFIGS}
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise UsageError(f"unknown config {unknown[0]!r}; see --list")
        configs = [known[n] for n in names] if names else list(CONFIGS)
        rows = validate(
            configs,
            steps=args.steps,
            at=args.at,
            out=args.out,
            timeout=args.timeout,
            progress=lambda line: print(f"validate: {line}", file=sys.stderr, flush=True),
        )
    except DetraceError as err:
        print(f"detrace validate: error: {err}", file=sys.stderr)
        return err.exit_code
    except subprocess.TimeoutExpired as err:
        print(f"detrace validate: error: a verification command ran past {err.timeout:.0f} s", file=sys.stderr)
        return 2
    print(table(rows))
    green = all(c.ok is not False for _, *cells, _ in rows for c in cells)
    return VALIDATE["green" if green else "failures"]
