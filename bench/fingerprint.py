"""Fingerprint throughput: detrace-fp2 against detrace-fp1, torch.hash_tensor and torch.sum of the same tensor.

Usage: python bench/fingerprint.py [--rounds N] [--fresh N] [--sizes 1,64,256] [--pool-mib 128]

Everything runs on the default path (`DETRACE_FINGERPRINT_BACKEND=auto`: the native kernels on the CPU), each
scheme chosen per call (`fingerprint(x, scheme=...)`). `torch.sum` is the memory-speed floor: it reads every byte
once and does almost nothing with it.

1. Fresh processes (--fresh rounds, 5 by default): each process imports detrace and calls one of fp2, fp1,
   torch.hash_tensor and torch.sum five times on a float32 64 MiB tensor on one thread, a process per function and
   round, the four one after the other; CPU time of the process. Figures: (other's time / fp2's time) of
   the first call and of the five calls, geometric mean over the rounds with its 95% interval.
2. Per core: one thread, CPU time of the calling thread (so that other processes on a shared machine cost nothing),
   float32 and bfloat16 at each size, placed two ways: "from memory" (a rotation through --pool-mib of tensors
   or more, by default 128 MiB: four times the L3 of the machine measured, so that every call reads DRAM: the
   memory-speed floor) and "in cache" for sizes up to 16 MiB (the same tensor every call: `sum` then reads L2/L3,
   far faster than memory).
   fp1, fp2, hash_tensor and sum interleaved round by round (every other round in reverse order), each round
   timing the same number of bytes (several calls for small tensors). A figure is the geometric mean over the
   rounds of (other's time / fp2's time), i.e. fp2's throughput relative to the other, with its 95% confidence
   interval (Student's t on the log ratios): ``per core fp2/sum float32 1MiB from memory: 0.93x [0.88, 0.98]``;
   fp1's throughput relative to sum's too (``fp1/sum``).
3. All threads: the same, wall time, with torch's default thread count.
4. Many small tensors in one fingerprint_many call, both schemes.

On a CUDA machine bench/gpu_check.py measures the GPU. The last lines are the figures, one per line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from overhead import interval

DTYPES = (torch.float32, torch.bfloat16)
# Tensors read in rotation for the "from memory" figures (--pool-mib): four times the 32 MiB L3 of the machine
# measured.
POOL_MIB = 128
# Sizes also measured "in cache" (fits its 2 MiB L2 or its L3).
CACHED_MAX_MIB = 16

_FRESH_PROBE = """
import sys, time, torch
t = time.perf_counter()
from detrace.digest import fingerprint
imported = time.perf_counter() - t
torch.set_num_threads(1)  # per core: an idle OpenMP thread's spinning would count as the process's CPU time
x = torch.randn(16 * 2**20)
fn = {"fp2": lambda: fingerprint(x, scheme="fp2"), "fp1": lambda: fingerprint(x, scheme="fp1"),
      "hash_tensor": lambda: torch.hash_tensor(x), "sum": lambda: x.sum()}[sys.argv[1]]
rows = []
for _ in range(5):
    t = time.process_time(); fn(); rows.append(time.process_time() - t)
print(imported, *rows)
"""
FRESH_FNS = ("fp2", "fp1", "hash_tensor", "sum")


def fresh_process(name: str) -> tuple[float, float, float]:
    """A fresh process that imports detrace.digest, then calls `name` five times on a float32 64 MiB tensor on one
    thread: (import seconds, CPU seconds of the first call, of all five)."""
    env = {**os.environ, "DETRACE_FINGERPRINT_BACKEND": "auto"}
    done = subprocess.run([sys.executable, "-c", _FRESH_PROBE, name], env=env, capture_output=True, text=True,
                          check=True)
    imported, *values = map(float, done.stdout.split())
    return imported, values[0], sum(values)


def fresh_figures(processes: int, figures: list[str]) -> None:
    """Each function's first call, each in its own fresh process, the four processes of a round one after the
    other (so that load drifts alike): ratios other/fp2 of the first call and of the five calls."""
    imports: list[float] = []
    first: dict[str, list[float]] = {name: [] for name in FRESH_FNS}
    five: dict[str, list[float]] = {name: [] for name in FRESH_FNS}
    for _ in range(processes):
        for name in FRESH_FNS:
            imported, one, all_five = fresh_process(name)
            imports.append(imported)
            first[name].append(one)
            five[name].append(all_five)
    print(f"fresh processes: import of detrace.digest {spread(imports, ' s')}; first fp2 call "
          f"{spread(first['fp2'], ' CPU s')}")
    for other in FRESH_FNS[1:]:
        for label, times in (("first call", first), ("five calls", five)):
            mean, low, high = interval([o / f for o, f in zip(times[other], times["fp2"], strict=True)])
            figures.append(f"fresh process fp2/{other} float32 64MiB {label}: {mean:.2f}x [{low:.2f}, {high:.2f}]")


def spread(values: list[float], unit: str = "x") -> str:
    """median [min..max]"""
    return f"{statistics.median(values):.2f}{unit} [{min(values):.2f}..{max(values):.2f}]"


def rounds_of(fns: dict[str, Callable[[], object]], rounds: int, reps: int,
              clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds of `reps` calls of each function, in rotation `rounds` times after one warm-up call each; every
    other round in reverse order, so that no function always follows the same one (whose leftovers in the caches
    and on the memory bus it would always meet)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds):
        for name, fn in list(fns.items())[:: -1 if round_ % 2 else 1]:
            start = clock()
            for _ in range(reps):
                fn()
            times[name].append(clock() - start)
    return times


def placements(mib: int, pool_mib: int) -> list[tuple[str, int]]:
    """(name, tensors in rotation) for a size: from memory (a pool of pool_mib or more, so that each call reads
    what the last pool_mib of calls evicted from the caches), and in cache (one tensor, the same every call) for
    sizes that fit the caches."""
    pool = max(1, -(-pool_mib // mib))
    return [("from memory", pool), *([("in cache", 1)] if mib <= CACHED_MAX_MIB else [])]


def contenders(pool: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """fp2, fp1, hash_tensor and sum, each call on the next tensor of one rotation that they share: a tensor comes
    back only after the whole pool was read."""
    from detrace.digest import fingerprint

    nxt = itertools.cycle(pool).__next__
    return {"fp2": lambda: fingerprint(nxt(), scheme="fp2"), "fp1": lambda: fingerprint(nxt(), scheme="fp1"),
            "hash_tensor": lambda: torch.hash_tensor(nxt()), "sum": lambda: nxt().sum()}


def measure(label: str, sizes: list[int], rounds: int, pool_mib: int, clock: Callable[[], float],
            figures: list[str]) -> None:
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for mib in sizes:
            for where, count in placements(mib, pool_mib):
                pool = [torch.randn(mib * 2**20 // torch.empty((), dtype=dtype).element_size()).to(dtype)
                        for _ in range(count)]
                fns = contenders(pool)
                reps = max(1, 32 // mib)  # at least 32 MiB per timed sample: small calls are timed in groups
                times = rounds_of(fns, rounds, reps, clock)
                gib = mib * reps / 1024
                speeds = ", ".join(f"{k} {gib / statistics.median(t):.1f}" for k, t in times.items())
                print(f"{label} {name} {mib}MiB {where} (GiB/s, median round): {speeds}", flush=True)
                for other in ("sum", "fp1", "hash_tensor"):
                    mean, low, high = interval([o / f for o, f in zip(times[other], times["fp2"], strict=True)])
                    figures.append(f"{label} fp2/{other} {name} {mib}MiB {where}: {mean:.2f}x [{low:.2f}, {high:.2f}]")
                mean, low, high = interval([s / f for s, f in zip(times["sum"], times["fp1"], strict=True)])
                figures.append(f"{label} fp1/sum {name} {mib}MiB {where}: {mean:.2f}x [{low:.2f}, {high:.2f}]")
                del pool, fns


def small_tensors() -> str:
    from detrace.digest import fingerprint_many

    tensors = [torch.randn(256) for _ in range(2000)]
    each = {}
    for scheme in ("fp1", "fp2"):
        fingerprint_many(tensors, scheme=scheme)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fingerprint_many(tensors, scheme=scheme)
            times.append(time.perf_counter() - start)
        each[scheme] = statistics.median(times) / len(tensors) * 1e6
    return (f"small tensors: {len(tensors)} x 1 KiB in one fingerprint_many call: fp1 {each['fp1']:.1f} us, "
            f"fp2 {each['fp2']:.1f} us each")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--fresh", type=int, default=5, help="fresh processes measured (0: skip)")
    parser.add_argument("--sizes", default="1,64,256", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--pool-mib", type=int, default=POOL_MIB,
                        help="MiB of tensors read in rotation for the from-memory figures (several times the L3)")
    args = parser.parse_args()
    if not hasattr(torch, "hash_tensor"):
        print("torch.hash_tensor needs torch>=2.8", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ["DETRACE_FINGERPRINT_BACKEND"] = "auto"
    threads = torch.get_num_threads()
    print(f"detrace fingerprint bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, {threads} torch threads, load average "
          f"{os.getloadavg()[0]:.1f}, {args.rounds} interleaved rounds")
    figures: list[str] = []
    if args.fresh:
        fresh_figures(args.fresh, figures)
    torch.set_num_threads(1)
    try:
        measure("per core", sizes, args.rounds, args.pool_mib, time.thread_time, figures)
    finally:
        torch.set_num_threads(threads)
    if threads > 1:
        measure(f"{threads} threads", sizes, args.rounds, args.pool_mib, time.perf_counter, figures)
    print(small_tensors())
    print("\n".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
