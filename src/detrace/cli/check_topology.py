"""`detrace check-topology [--worlds 1,2,4] [--threads N] [--out DIR] [--timeout S] [--json] [--force] -- CMD...`:
CMD run under torchrun at each world size must give the same losses and parameters, bit for bit, at every step.
Exit 0 the same bits at every world size, 1 not (the first step and tensor are named), 2 error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser, split_command
from detrace.topology import check_topology, parse_worlds
from detrace.verdicts import TOPOLOGY
from detrace.verify import default_out


def main(argv: list[str]) -> int:
    options, cmd = split_command(argv)
    parser = ArgumentParser("check-topology", "Run CMD under torchrun at each world size and require the same "
                            "losses and parameters, bit for bit, at every step.",
                            usage="detrace check-topology [options] -- CMD...")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes to run, the first the reference (default 1,2,4)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank, the same at every world size (OMP_NUM_THREADS; default 1)")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: detrace-topology-<time>)")
    parser.add_argument("--timeout", type=float, help="seconds each run may take before it is killed")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")
    parser.add_argument("--force", action="store_true",
                        help="start world sizes above 4 processes per CPU core (refused without it)")
    args = parser.parse_args(options)
    worlds = parse_worlds(args.worlds, force=args.force)
    result = check_topology(cmd, worlds=worlds, out=args.out or default_out("topology"), threads=args.threads,
                            timeout=args.timeout,
                            progress=lambda line: print(f"detrace check-topology: {line}", file=sys.stderr))
    if args.json:
        print(json.dumps(result.to_json()))
    elif result.first is None:
        final = result.finals[worlds[0]]
        print(f"identical: worlds {', '.join(map(str, worlds))} give the same bits ({result.steps} steps, "
              f"{result.tensors} parameters{', final params ' + final if final else ''})")
    else:
        print(f"diverged: {result.first.sentence(worlds[0])}")
    return TOPOLOGY["identical" if result.identical else "diverged"]
