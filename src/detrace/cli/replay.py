"""`detrace replay RUN --event ID`: the kernel rung alone, on an op call captured in a run directory."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from detrace.analyze.replay_result import ReplayConfig, ReplayResult
from detrace.cli._args import ArgumentParser
from detrace.report.terminal import make_console
from detrace.verdicts import REPLAY


def render(result: ReplayResult, console: Console) -> None:
    """The human summary: verdict, where the call came from, and one row per arm."""
    meta = result.meta
    where = ", ".join(f"{k} {meta[k]}" for k in ("rank", "step", "phase", "module") if meta.get(k) is not None)
    verdict = "[bold red]nondeterministic[/]" if result.nondeterministic else "[bold green]deterministic[/]"
    console.print(f"{result.op}{f' ({where})' if where else ''}: {verdict} over {result.base.repeats} repeats "
                  f"with {result.base.threads} thread(s), deterministic algorithms "
                  f"{'on' if result.base.deterministic else 'off'}")
    if result.nondeterministic:
        console.print(f"  up to {result.base.differing_elements} elements differ, by up to {result.base.max_ulp} ULP")
        console.print("  fixed by: " + (", ".join(result.fixed_by) or "none of the switches tried"))
    for advice in result.advice:  # a compiled kernel's switches act when Inductor generates code: not tried here
        console.print(f"  advice: {advice}", markup=False)
    table = Table("threads", "deterministic algorithms", "repeats", "distinct outputs", "differing elements",
                  "max ULP", "note")
    for arm in result.arms:
        table.add_row(str(arm.threads), "on" if arm.deterministic else "off", str(arm.repeats), str(arm.distinct),
                      str(arm.differing_elements), str(arm.max_ulp), arm.note(result.base))
    console.print(table)


def main(argv: list[str]) -> int:
    parser = ArgumentParser("replay", "Kernel rung: re-execute one captured op call many times, with 1 and N "
                            "threads and deterministic algorithms off and on. A compiled kernel's capture names Python "
                            "code, which runs only with --trust-code. Exit 0 deterministic, 1 not, 2 no answer.")
    parser.add_argument("run", metavar="RUN", help="run directory holding capture/rank-*-seq*.safetensors")
    parser.add_argument("--event", required=True, metavar="ID",
                        help="the captured call: its seq number, or the path of its capture file")
    parser.add_argument("--rank", type=int, default=None, help="the rank, when several ranks captured that seq")
    parser.add_argument("--repeats", type=int, default=ReplayConfig().repeats, help="executions per arm")
    parser.add_argument("--threads", default=None, metavar="N[,N...]",
                        help="thread counts to try (default: 1 and the traced run's count)")
    parser.add_argument("--trust-code", action="store_true",
                        help="execute the compiled kernel's output code file that a capture names (Python code; "
                        "only for traces you trust), and only while its SHA-256 matches the one recorded at capture")
    parser.add_argument("--json", action="store_true", help="print the detrace.replay/1 object on stdout")
    args = parser.parse_args(argv)
    threads = None
    if args.threads:
        try:
            threads = tuple(int(t) for t in args.threads.split(","))
        except ValueError:
            parser.error(f"--threads takes comma-separated integers, not {args.threads!r}")
    config = ReplayConfig(repeats=args.repeats, threads=threads)
    from detrace.investigate.replay import find_capture, replay_file  # torch: after the arguments are known to be good

    result = replay_file(find_capture(args.run, args.event, rank=args.rank), config,
                         trust_code=args.trust_code)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        render(result, make_console())
    return REPLAY["nondeterministic" if result.nondeterministic else "deterministic"]
