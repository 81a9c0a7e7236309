"""Benchmark of the checkpointed ladder: `detrace locate` on a divergence late in a run, resumed from checkpoints
against today's full-run ladder (`--no-checkpoints`), side by side.

The workload is the reference trainer with a planted late race: deterministic for S = N - 8 steps of an N-step
run, then the real race of its MoE index dispatch (`--nondeterministic-from S`). For each N
the two ladders run alternately (checkpointed, full, checkpointed, full, ...), so that the machine's load falls on
both alike. It checks that the checkpointed ladder resumed (the proof held), named the racing index_put, and that
the runs after the broad pair (the resume proof and the narrow rungs) executed at most 6 x (K + 1) steps, K the
checkpoint interval: a bound that does not depend on S.

Prints, as its last lines, one figure per line and N: the steps executed after the broad pair by each ladder
(median), and the total wall time of each ladder and their ratio (median, with the range over the repeats).

    python bench/locate.py                      # N = 32 and 256, 3 repeats each
    python bench/locate.py --steps 32 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVERY = 8
"""K, the checkpoint interval (locate's default)."""


def command(steps: int) -> list[str]:
    return [sys.executable, "-m", "detrace.workload.train", "--preset", "tiny", "--threads", "2",
            "--steps", str(steps), "--nondeterministic-from", str(steps - 8)]


def ladder(out: Path, steps: int, *, checkpoints: bool) -> tuple[float, dict]:
    """One `detrace locate --json` in a child process: (wall seconds, its detrace.locate/1 object)."""
    args = ["--checkpoint-every", str(EVERY)] if checkpoints else ["--no-checkpoints"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "detrace", "locate", "--json", "--out", str(out), *args, "--",
                           *command(steps)], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    try:
        return wall, json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"locate printed no JSON (exit {done.returncode}): {done.stderr[-2000:]}") from None


def after_broad(result: dict) -> int:
    """Steps executed by every run after the broad pair (the resume proof, the narrow rungs, the capture)."""
    return sum(run["steps"] for run in result["cost"]["per_run"] if not run["run"].startswith("1-"))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} (range {min(values):.1f}-{max(values):.1f}, n={len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[32, 256], help="run lengths N (default 32 256)")
    parser.add_argument("--repeats", type=int, default=3, help="ladders of each kind per N (default 3)")
    args = parser.parse_args()
    figures: list[str] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="detrace-bench-locate-") as tmp:
        for steps in args.steps:
            walls: dict[bool, list[float]] = {True: [], False: []}
            executed: dict[bool, list[int]] = {True: [], False: []}
            for repeat in range(args.repeats):
                for checkpoints in (True, False):  # interleaved
                    out = Path(tmp) / f"n{steps}-{repeat}-{'ckpt' if checkpoints else 'full'}"
                    wall, result = ladder(out, steps, checkpoints=checkpoints)
                    shutil.rmtree(out, ignore_errors=True)
                    cost = result["cost"]
                    culprit = (result.get("culprit") or {}).get("name", "-")
                    print(f"N={steps} {'checkpointed' if checkpoints else 'full-run'} ladder {repeat + 1}: "
                          f"{result['verdict']} ({culprit}), {cost['runs']} runs, {after_broad(result)} steps after "
                          f"the broad pair, resume {cost['resume']}, {wall:.1f} s", flush=True)
                    if checkpoints and result["verdict"] == "nondeterministic" and (
                            cost["resume"] != "exact" or after_broad(result) > 6 * (EVERY + 1)):
                        print(f"FAILED: the checkpointed ladder did not resume within 6 x (K + 1) = "
                              f"{6 * (EVERY + 1)} steps", file=sys.stderr)
                        failed = True
                    walls[checkpoints].append(wall)
                    executed[checkpoints].append(after_broad(result))
            ratios = [full / ckpt for ckpt, full in zip(walls[True], walls[False], strict=True)]
            figures += [
                f"N={steps} S={steps - 8} steps after the broad pair, checkpointed: "
                f"{statistics.median(executed[True]):.0f} (bound {6 * (EVERY + 1)})",
                f"N={steps} S={steps - 8} steps after the broad pair, full runs: "
                f"{statistics.median(executed[False]):.0f}",
                f"N={steps} wall time, checkpointed ladder: {spread(walls[True])} s",
                f"N={steps} wall time, full-run ladder: {spread(walls[False])} s",
                f"N={steps} speed-up (full / checkpointed, paired): {spread(ratios)}",
            ]
    for line in figures:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
