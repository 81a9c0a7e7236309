"""Fingerprint throughput: detrace-fp2 against detrace-fp1, torch.hash_tensor and torch.sum of the same tensor.

Usage: python bench/fingerprint.py [--rounds N] [--fresh N] [--sizes 1,64,256]

Everything runs on the default path (`DETRACE_FINGERPRINT_BACKEND=auto`: the native kernels on the CPU), each
scheme chosen per call (`fingerprint(x, scheme=...)`). `torch.sum` is the memory-speed floor: it reads every byte
once and does almost nothing with it.

1. Fresh processes (--fresh, 5 by default): each imports detrace and hashes a float32 64 MiB tensor five times with
   fp1, fp2 and torch.hash_tensor in turn; the figures are the first-call and five-call ratios (fp1 time / fp2 time,
   hash_tensor time / fp2 time), median over the processes with their range.
2. Per core: one thread, CPU time of the calling thread (so that other processes on a shared machine cost nothing),
   float32 and bfloat16 at each size; fp1, fp2, hash_tensor and sum interleaved round by round, each round timing
   the same number of bytes (several calls for small tensors). A figure is the geometric mean over the rounds of
   (other's time / fp2's time), i.e. fp2's throughput relative to the other, with its 95% confidence interval
   (Student's t on the log ratios): ``per core fp2/sum float32 1MiB: 0.93x [0.88, 0.98]``.
3. All threads: the same, wall time, with torch's default thread count.
4. Many small tensors in one fingerprint_many call, both schemes.

On a CUDA machine bench/gpu_check.py measures the GPU. The last lines are the figures, one per line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from overhead import interval

DTYPES = (torch.float32, torch.bfloat16)

_FRESH_PROBE = """
import time, torch
t = time.perf_counter()
from detrace.digest import fingerprint
imported = time.perf_counter() - t
x = torch.randn(16 * 2**20)
rows = []
for _ in range(5):
    for fn in (lambda: fingerprint(x, scheme="fp1"), lambda: fingerprint(x, scheme="fp2"),
               lambda: torch.hash_tensor(x)):
        t = time.perf_counter(); fn(); rows.append(time.perf_counter() - t)
print(imported, *rows)
"""


def fresh_process() -> tuple[float, float, float, float, float]:
    """A fresh process hashing fp32 64 MiB five times with fp1, fp2 and hash_tensor in turn: (import seconds,
    first-call fp1/fp2, five-call fp1/fp2, first-call hash_tensor/fp2, longest fp2 call)."""
    env = {**os.environ, "DETRACE_FINGERPRINT_BACKEND": "auto"}
    done = subprocess.run([sys.executable, "-c", _FRESH_PROBE], env=env, capture_output=True, text=True, check=True)
    imported, *values = map(float, done.stdout.split())
    fp1, fp2, hashes = values[0::3], values[1::3], values[2::3]
    return imported, fp1[0] / fp2[0], sum(fp1) / sum(fp2), hashes[0] / fp2[0], max(fp2)


def spread(values: list[float], unit: str = "x") -> str:
    """median [min..max]"""
    return f"{statistics.median(values):.2f}{unit} [{min(values):.2f}..{max(values):.2f}]"


def rounds_of(fns: dict[str, Callable[[], object]], rounds: int, reps: int,
              clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds of `reps` calls of each function, in rotation `rounds` times after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            for _ in range(reps):
                fn()
            times[name].append(clock() - start)
    return times


def measure(label: str, sizes: list[int], rounds: int, clock: Callable[[], float], figures: list[str]) -> None:
    from detrace.digest import fingerprint

    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for mib in sizes:
            x = torch.randn(mib * 2**20 // torch.empty((), dtype=dtype).element_size()).to(dtype)
            fns = {"fp2": lambda x=x: fingerprint(x, scheme="fp2"), "fp1": lambda x=x: fingerprint(x, scheme="fp1"),
                   "hash_tensor": lambda x=x: torch.hash_tensor(x), "sum": lambda x=x: x.sum()}
            reps = max(1, 32 // mib)  # at least 32 MiB per timed sample: small calls are timed in groups
            times = rounds_of(fns, rounds, reps, clock)
            gib = mib * reps / 1024
            speeds = ", ".join(f"{k} {gib / statistics.median(t):.1f}" for k, t in times.items())
            print(f"{label} {name} {mib}MiB (GiB/s, median round): {speeds}", flush=True)
            for other in ("sum", "fp1", "hash_tensor"):
                mean, low, high = interval([o / f for o, f in zip(times[other], times["fp2"], strict=True)])
                figures.append(f"{label} fp2/{other} {name} {mib}MiB: {mean:.2f}x [{low:.2f}, {high:.2f}]")
            del x


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
        runs = [fresh_process() for _ in range(args.fresh)]
        imported, first, five, hashed, longest = (list(column) for column in zip(*runs, strict=True))
        print(f"fresh processes: import of detrace.digest {spread(imported, ' s')}")
        figures.append(f"fresh process fp2 float32 64MiB ({args.fresh} processes): first call fp1/fp2 "
                       f"{spread(first)}, five calls fp1/fp2 {spread(five)}, first call hash_tensor/fp2 "
                       f"{spread(hashed)}; longest fp2 call {spread(longest, ' s')}")
    torch.set_num_threads(1)
    try:
        measure("per core", sizes, args.rounds, time.thread_time, figures)
    finally:
        torch.set_num_threads(threads)
    if threads > 1:
        measure(f"{threads} threads", sizes, args.rounds, time.perf_counter, figures)
    print(small_tensors())
    print("\n".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
