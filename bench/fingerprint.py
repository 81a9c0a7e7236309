"""Fingerprint throughput against torch.hash_tensor and torch.sum of the same tensor (CPU; CUDA when present).

Usage: python bench/fingerprint.py [--repeats N] [--no-startup]

Everything runs on the default path (`DETRACE_FINGERPRINT_BACKEND=auto`: the native kernel on the CPU).
First, fresh processes (--fresh of them, 5 by default): each imports detrace and hashes a float32 64 MiB tensor
five times, interleaved with torch.hash_tensor of it; the fresh figures are the ratio of the first calls (what a
program gets from its first fingerprint on), the five-call ratio, and the longest single call (a pause inside a
traced step), each as the median over the processes with their range. Then the steady
figures: for float32 and bfloat16 tensors of 64 and 256 MiB, detrace.fingerprint, torch.hash_tensor (an XOR
fold that upcasts each element to 64 bits) and torch.sum (about one read of memory), interleaved round by
round so that load on the machine hits all three alike, the median of the per-round ratios. The last lines
are the figures, one per line, e.g. ``fingerprint/hash_tensor float32 64MiB: 1.83x``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

SIZES_MIB = (64, 256)
DTYPES = (torch.float32, torch.bfloat16)

_FRESH_PROBE = """
import time, torch
t = time.perf_counter()
from detrace.digest import fingerprint
imported = time.perf_counter() - t
x = torch.randn(16 * 2**20)
rows = []
for _ in range(5):
    t = time.perf_counter(); fingerprint(x); f = time.perf_counter() - t
    t = time.perf_counter(); torch.hash_tensor(x); h = time.perf_counter() - t
    rows.append((f, h))
print(imported, *(v for row in rows for v in row))
"""


def fresh_process() -> tuple[float, float, float, float]:
    """A fresh process on the default path hashing fp32 64 MiB five times, interleaved with hash_tensor:
    (import seconds, first-call ratio hash_tensor/fingerprint, ratio over the five calls, longest call)."""
    env = {**os.environ, "DETRACE_FINGERPRINT_BACKEND": "auto"}
    done = subprocess.run([sys.executable, "-c", _FRESH_PROBE], env=env, capture_output=True, text=True, check=True)
    imported, *values = map(float, done.stdout.split())
    prints, hashes = values[0::2], values[1::2]
    return imported, hashes[0] / prints[0], sum(hashes) / sum(prints), max(prints)


def spread(values: list[float], unit: str = "x") -> str:
    """median [min..max]"""
    return f"{statistics.median(values):.2f}{unit} [{min(values):.2f}..{max(values):.2f}]"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, object], device: torch.device, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in rotation `repeats` times after one warm-up call each."""
    for fn in fns.values():
        fn()  # type: ignore[operator]
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def measure(device: torch.device, repeats: int, figures: list[str]) -> None:
    from detrace.digest import fingerprint

    for dtype in DTYPES:
        for mib in SIZES_MIB:
            numel = mib * 2**20 // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(numel, device=device).to(dtype)
            fns = {"fingerprint": lambda x=x: fingerprint(x), "hash_tensor": lambda x=x: torch.hash_tensor(x),
                   "sum": lambda x=x: x.sum()}
            if device.type == "cuda":
                fns["copy"] = lambda x=x: x.clone()
            times = interleaved(fns, device, repeats)
            gib = mib / 1024
            speeds = ", ".join(f"{name} {gib / statistics.median(t):.1f} GiB/s" for name, t in times.items())
            print(f"{device.type} {str(dtype).removeprefix('torch.')} {mib}MiB: {speeds}")
            name = str(dtype).removeprefix("torch.")
            prefix = "" if device.type == "cpu" else "cuda "
            for other in [k for k in fns if k != "fingerprint"]:
                ratio = statistics.median(o / f for o, f in zip(times[other], times["fingerprint"], strict=True))
                figures.append(f"{prefix}fingerprint/{other} {name} {mib}MiB: {ratio:.2f}x")
            del x


def per_core() -> str:
    """CPU time per byte on one thread: what each implementation costs a core, whatever else the machine runs."""
    from detrace.digest import fingerprint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(16 * 2**20)
        fns = {"fingerprint": lambda: fingerprint(x), "hash_tensor": lambda: torch.hash_tensor(x), "sum": x.sum}
        for fn in fns.values():
            fn()
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(5):
            for name, fn in fns.items():
                start = time.process_time()
                fn()
                cpu[name].append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    rates = ", ".join(f"{name} {0.0625 / max(statistics.median(t), 1e-9):.1f}" for name, t in cpu.items())
    return f"per core (1 thread, float32 64MiB, GiB per CPU-second): {rates}"


def small_tensors() -> str:
    from detrace.digest import fingerprint_many

    tensors = [torch.randn(256) for _ in range(2000)]
    fingerprint_many(tensors)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fingerprint_many(tensors)
        times.append(time.perf_counter() - start)
    each = statistics.median(times) / len(tensors) * 1e6
    return f"small tensors: {len(tensors)} x 1 KiB in one fingerprint_many call: {each:.1f} us each"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--fresh", type=int, default=5, help="fresh processes measured (0: skip)")
    args = parser.parse_args()
    if not hasattr(torch, "hash_tensor"):
        print("torch.hash_tensor needs torch>=2.8", file=sys.stderr)
        return 2
    os.environ["DETRACE_FINGERPRINT_BACKEND"] = "auto"
    print(f"detrace fingerprint bench: torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"default (auto) path, median of {args.repeats} interleaved rounds")
    figures: list[str] = []
    if args.fresh:
        runs = [fresh_process() for _ in range(args.fresh)]
        imported, first, five, longest = (list(column) for column in zip(*runs, strict=True))
        print(f"fresh processes: import of detrace.digest {spread(imported, ' s')}, longest call "
              f"{spread(longest, ' s')}")
        figures.append(f"fresh process fingerprint/hash_tensor float32 64MiB ({args.fresh} processes): first call "
                       f"{spread(first)}, five calls {spread(five)}; longest call {spread(longest, ' s')}")
    measure(torch.device("cpu"), args.repeats, figures)
    print(per_core())
    print(small_tensors())
    if torch.cuda.is_available():
        measure(torch.device("cuda"), args.repeats, figures)
    else:
        print("GPU: not measured (no CUDA device here)")
    print("\n".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
