"""Benchmark of `detrace diff` at scale: a synthetic data-parallel run, diffed on every core in bounded memory.

Writes a run of --ranks ranks x --records records per rank twice through the real writer (RankWriter.add_batch),
the second time with an injected fault (named as such: `Fault` of tests/support/_synthetic.py) on one rank whose
divergence reaches every other rank through the gradient all_reduce. Measures one core's speed on identical
traces (ranks of A against themselves, in this process). Then runs `detrace diff A B --json` in a child process,
checks that it names the planted rank as the only origin and every other rank as a receiver via that all_reduce,
and prints, as its last three lines: aligned records per second, the peak resident memory of the largest diff
process (its workers included), and the diff's wall time. Deletes both runs at the end.

    python bench/diff.py                       # 608 ranks x 20,000 records per rank (~4 GiB of traces)
    python bench/diff.py --ranks 2432          # the full 2,432-rank run (~16 GiB of traces)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detrace.analyze.align import align_rank
from detrace.analyze.pool import cores, map_ranks
from detrace.tracefile import open_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # synthetic traces: a test fixture
from _synthetic import Fault, SyntheticRun, write_rank

RANKS = 608
"""Default world size: a quarter of the 2,432-rank run, which needs ~16 GiB of traces and, on a 2-core machine whose
disk reads and writes ~100 MB/s, about 7 minutes (`--ranks 2432` runs it)."""


def shape(records: int) -> tuple[int, int]:
    """(steps, ops) whose synthetic rank holds `records` records (4*ops + 5 per step), as close as possible."""
    exact = [(steps, (records // steps - 5) // 4) for steps in range(10, 101)
             if records % steps == 0 and (records // steps - 5) % 4 == 0 and records // steps > 5]
    if exact:
        return exact[0]
    return 20, max(1, (records // 20 - 5) // 4)


def write(task: tuple[str, SyntheticRun, int, Fault | None]) -> int:
    out, run, rank, fault = task
    return write_rank(out, run, rank, fault)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=RANKS, help=f"world size of the synthetic run (default {RANKS})")
    parser.add_argument("--records", type=int, default=20000, help="records per rank (default 20000)")
    parser.add_argument("--workers", type=int, default=cores(), help="processes (default: every core)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the two runs (default: a temp dir)")
    args = parser.parse_args()
    steps, ops = shape(args.records)
    run = SyntheticRun(ranks=args.ranks, steps=steps, ops=ops)
    fault = Fault(rank=args.ranks // 3, step=steps // 2, op=ops // 2)
    base = Path(tempfile.mkdtemp(prefix="detrace-bench-diff-", dir=args.dir))
    a, b = base / "a", base / "b"
    try:
        started = time.perf_counter()
        written = 0
        for out, planted in ((a, None), (b, fault)):
            tasks = [(str(out), run, rank, planted) for rank in range(run.ranks)]
            written += sum(map_ranks(write, tasks, workers=args.workers))
        size = sum(p.stat().st_size for p in base.rglob("*.arrow"))
        print(f"wrote 2 runs x {run.ranks} ranks x {run.records_per_rank} records ({written:,} records, "
              f"{size / 2**30:.1f} GiB) in {time.perf_counter() - started:.1f} s; injected fault: {fault}")

        sample = range(min(run.ranks, 64))
        files = open_run(a).files
        started = time.perf_counter()
        aligned = sum(align_rank((rank, files[rank], files[rank], 0, None, None)).records for rank in sample)
        print(f"identical traces, one core: {aligned / (time.perf_counter() - started):,.0f} records/s "
              f"({len(sample)} ranks of run A against themselves, in this process)")

        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "detrace", "diff", str(a), str(b), "--json",
                                  "--workers", str(args.workers)], stdout=subprocess.PIPE)
        out = child.stdout.read() if child.stdout else b""
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        result = json.loads(out)
        receivers = {r["via"] for r in result["ranks"] if r["rank"] != fault.rank}
        print(f"diff exit {child.returncode}: verdict {result['verdict']}, origin ranks {result['origin_ranks']}, "
              f"first {result['first']['name']} in {result['first']['module']} at step {result['first']['step']}, "
              f"other ranks received it via {sorted(receivers)}")
        found = (child.returncode == 1 and result["origin_ranks"] == [fault.rank]
                 and receivers == {f"all_reduce#{fault.step} group {run.group}"})
        if not found:
            print("FAILED: the planted origin rank was not found", file=sys.stderr)
        records = result["compared"]["records"]
        cpu = usage.ru_utime + usage.ru_stime
        print(f"diff CPU time {cpu:.1f} s over {wall:.1f} s of wall time: {records / max(cpu, 1e-9):,.0f} records per "
              f"CPU-second (the rest is waiting for the disk, or for the cores other processes hold)")
        # ru_maxrss of a reaped child is the largest resident set of it and the descendants it reaped (KiB).
        print(f"records/s: {records / wall:,.0f} ({records:,} aligned records, {args.workers} workers)")
        print(f"peak memory (RSS): {usage.ru_maxrss / 1024:.0f} MiB")
        print(f"wall time: {wall:.1f} s")
        return 0 if found else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
