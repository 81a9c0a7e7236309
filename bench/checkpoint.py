"""Checkpoints at disk speed: `detrace verify-checkpoint` and the fingerprint manifest written at save, against
reading and writing the same bytes.

    python bench/checkpoint.py [--gib 2] [--rounds 5] [--dir DIR] [--cold]

A TrainState (a model of a few large parameters and its AdamW moments, --gib GiB in all) is saved once under DIR
(a temporary directory by default; deleted at the end). Then, interleaved round by round:

- verify: `verify_checkpoint` of that version (every stored chunk read back and fingerprinted against the
  manifest) against `cat FILES > /dev/null` of its files: on 1 core (torch 1 thread, one `cat`) and on all cores
  (torch's default threads, one `cat` per file in parallel). With --cold the files' pages are dropped from the
  page cache before each timed call (`posix_fadvise(DONTNEED)` on each file after a sync: no root needed): the
  disk's speed; without it, the files are in the page cache: the memory and CPU side alone.
- save: `TrainState.save` (DCP's write with fsync, plus the manifest: every chunk fingerprinted, the JSON
  checksummed) against DCP's own `dcp.save` of the same tensors with the same fsync, each into a fresh directory,
  the two in turn first (the one written second finds the disk's cache busier).

A figure is the geometric mean over the rounds of (detrace's time / the plain read's or write's), with its 95%
confidence interval (Student's t on the log ratios): `verify/read warm all cores: 1.35x [1.20, 1.52]`.
The last lines are the figures, one per line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from overhead import interval

from detrace.state import TrainState, verify_checkpoint

_PARAMETERS = 8  # the model's parameters: one chunk each, and as many for each AdamW moment


def make_state(gib: float) -> TrainState:
    """A model whose parameters and two AdamW moments take `gib` GiB, after one optimizer step."""
    numel = int(gib * 2**30 / 4 / 3 / _PARAMETERS)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel)) for _ in range(_PARAMETERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer)  # type: ignore[arg-type]


def drop_cached(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages only: hence the sync first)."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object], cold: list[Path] | None) -> float:
    if cold is not None:
        drop_cached(cold)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cat(files: list[Path], parallel: bool) -> None:
    if parallel:
        procs = [subprocess.Popen(["cat", str(f)], stdout=subprocess.DEVNULL) for f in files]
        if any(p.wait() for p in procs):
            raise RuntimeError("cat failed")
    else:
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size in GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (a temporary directory under it)")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache before each call")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    here = Path(tempfile.mkdtemp(prefix="detrace-ckpt-bench-", dir=args.dir))
    figures: list[str] = []
    try:
        state = make_state(args.gib)
        version = state.save(here / "ckpt")
        files = sorted(p for p in version.iterdir() if p.is_file())
        size = sum(p.stat().st_size for p in files)
        print(f"detrace checkpoint bench, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {size / 2**30:.2f} "
              f"GiB in {len(files)} files under {here}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
              f"{args.rounds} interleaved rounds, page cache {'dropped before each call' if args.cold else 'warm'}",
              flush=True)
        cache = "cold" if args.cold else "warm"
        cold = files if args.cold else None
        for label, n, parallel in (("1 core", 1, False), ("all cores", threads, True)):
            torch.set_num_threads(n)
            times: dict[str, list[float]] = {"verify": [], "read": []}
            for _ in range(args.rounds):
                times["read"].append(timed(lambda parallel=parallel: cat(files, parallel), cold))
                times["verify"].append(timed(lambda: verify_checkpoint(version), cold))
            gib = size / 2**30
            speeds = ", ".join(f"{k} {gib / sorted(v)[len(v) // 2]:.2f} GiB/s (median)" for k, v in times.items())
            print(f"{label} ({cache}): {speeds}", flush=True)
            mean, low, high = interval([v / r for v, r in zip(times["verify"], times["read"], strict=True)])
            figures.append(f"verify/read {cache} {label}: {mean:.2f}x [{low:.2f}, {high:.2f}]")
        torch.set_num_threads(threads)
        tensors = {f"model.{i}": p.detach() for i, p in enumerate(state.model.parameters())}  # type: ignore[union-attr]
        tensors |= {f"optimizer.{i}.{k}": v for i, s in enumerate(state.optimizer.state.values())  # type: ignore[union-attr]
                    for k, v in s.items() if v.dim()}
        saves: dict[str, list[float]] = {"detrace": [], "dcp": []}
        for r in range(args.rounds):
            shutil.rmtree(here / "ckpt")
            plain = here / f"plain-{r}"
            calls = {"detrace": lambda: state.save(here / "ckpt"),
                     "dcp": lambda plain=plain: dcp.save(
                         tensors, storage_writer=dcp.FileSystemWriter(plain, sync_files=True), no_dist=True)}
            for name in sorted(calls, reverse=r % 2 == 1):  # every other round the other first: the disk's state
                saves[name].append(timed(calls[name], None))
            shutil.rmtree(plain)
        print(f"save: detrace {size / 2**30 / sorted(saves['detrace'])[args.rounds // 2]:.2f} GiB/s, plain DCP "
              f"{size / 2**30 / sorted(saves['dcp'])[args.rounds // 2]:.2f} GiB/s (medians)", flush=True)
        mean, low, high = interval([d / p for d, p in zip(saves["detrace"], saves["dcp"], strict=True)])
        figures.append(f"save with manifest/plain DCP save: {mean:.2f}x [{low:.2f}, {high:.2f}]")
    finally:
        shutil.rmtree(here, ignore_errors=True)
    print("\n".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
