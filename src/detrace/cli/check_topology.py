"""`detrace check-topology [--worlds 1,2,4 | --layouts fsdp1,fsdp2 | 1x1,1x2,2x2] [--resume-at K] [--threads N]
[--out DIR] [--timeout S] [--json] [--force] -- CMD...`: CMD run under torchrun at each layout must give the same
losses and parameters, bit for bit, at every step; with --resume-at K, CMD stopped after step K at the first world
size and resumed at each other must give the bits of the run that never stopped.
Exit 0 the same bits, 1 not (the first step and tensor are named, then each run's own verdict), 2 error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.errors import UsageError
from detrace.investigate.check_topology import Mesh, Mismatch, check_topology, parse_layouts, parse_worlds
from detrace.tracefile.layout import default_out
from detrace.verdicts import TOPOLOGY


def main(argv: list[str]) -> int:
    options, cmd = split_command(argv)
    parser = ArgumentParser("check-topology", "Run CMD under torchrun at each world size or DP x TP layout and "
                            "require the same losses and parameters, bit for bit, at every step.",
                            usage="detrace check-topology [options] -- CMD...")
    parser.add_argument("--worlds", help="world sizes to run, the first the reference (default 1,2,4)")
    parser.add_argument("--layouts", help="layouts to run instead: named dimensions joined by x, e.g. "
                        "fsdp1,fsdp2,fsdp4, or DxT meshes 1x1,1x2,2x2 (CMD gets DETRACE_LAYOUT=NAME and DETRACE_TP=T)")
    parser.add_argument("--resume-at", type=int, metavar="K",
                        help="elastic resume: stop the first world size (or layout) after step K, resume on each other")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank, the same at every world size (OMP_NUM_THREADS; default 1)")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: detrace-runs/topology-<time>)")
    parser.add_argument("--timeout", type=seconds, help="seconds each run may take before it is killed")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")
    parser.add_argument("--force", action="store_true",
                        help="start worlds or layouts of more than 4 processes per CPU core (refused without it)")
    args = parser.parse_args(options)
    layouts = args.layouts is not None  # an empty --worlds or --layouts is refused, never the default
    if args.worlds is not None and layouts:
        raise UsageError("give --worlds or --layouts, not both")
    meshes = parse_layouts(args.layouts, force=args.force) if layouts else \
        tuple(Mesh(dp=w) for w in parse_worlds("1,2,4" if args.worlds is None else args.worlds, force=args.force))
    result = check_topology(cmd, meshes=meshes, out=args.out or default_out("topology"), threads=args.threads,
                            timeout=args.timeout, resume_at=args.resume_at, tp_env=layouts,
                            progress=lambda line: print(f"detrace check-topology: {line}", file=sys.stderr))
    if args.json:
        print(json.dumps(result.to_json()))
    elif result.first is None:
        final = result.finals[result.reference]
        # ranks that held plain shards: those parameters are compared through the final params line only
        unsharded = " of the unsharded layouts" if result.partial else ""
        tensors = f"{result.tensors} parameters{unsharded}, " if result.tensors else ""
        print(f"identical: {_what(meshes, layouts=layouts, resume_at=args.resume_at)} "
              f"({result.steps} steps, {tensors}final params {final})" if final else
              f"identical: {_what(meshes, layouts=layouts, resume_at=args.resume_at)} "
              f"({result.steps} steps, {result.tensors} parameters)")
    else:
        print(f"diverged: {result.first.sentence(result.reference)}{_param(result.first_param)}")
        if len(result.verdicts) > 1:  # each run's own verdict: which layouts keep the bits and which do not
            for v in result.verdicts:
                print(f"  {v.run}: identical" if v.first is None else
                      f"  {v.run}: its ranks disagree {v.first.place()}" if v.first.kind == "ranks" else
                      f"  {v.run}: diverged {v.first.place()}{_param(v.first_param)}")
    return TOPOLOGY["identical" if result.identical else "diverged"]


def _param(param: Mismatch | None) -> str:
    """The first parameter that differs, when the first record that differs is another."""
    if param is None:
        return ""
    when = "at the end" if param.step < 0 else f"at step {param.step}"
    return f"; the first parameter that differs: {param.name} {when}"


def _what(meshes: tuple[Mesh, ...], *, layouts: bool, resume_at: int | None) -> str:
    """What the identical verdict says was the same."""
    if resume_at is None:
        if layouts:
            return f"layouts {', '.join(m.label for m in meshes)} give the same bits"
        return f"worlds {', '.join(str(m.world) for m in meshes)} give the same bits"
    if layouts:
        return (f"layout {meshes[0].label} stopped after step {resume_at} and resumed on layout "
                f"{', '.join(m.label for m in meshes[1:])} gives the bits of the run that never stopped")
    others = ", ".join(str(m.world) for m in meshes[1:])
    return (f"world {meshes[0].world} stopped after step {resume_at} and resumed at world {others} gives the bits "
            "of the run that never stopped")
