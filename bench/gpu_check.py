"""One prepared GPU check of detrace, made to finish within 8 minutes on one GPU.

    python bench/gpu_check.py [--quick]

Sections (each prints its figures; a failed determinism check makes the exit status 1):
  fingerprints     CUDA fingerprints equal to CPU fingerprints, for every dtype detrace fingerprints, in both
                   schemes (fp2 on CUDA is the Triton kernel of detrace.digest._triton)
  throughput       fp1 and fp2 fingerprint GiB/s against torch.hash_tensor, a copy (clone) and a sum of the same
                   tensor
  kernels          detrace.ops' Triton kernels: identical bits across runs and tile shapes, bit-equal to the
                   PyTorch path where the order is the same, and time ratios against the racing (atomic) ops and
                   against torch's deterministic mode
  overhead         per-rung tracer overhead on the `small` preset, on the GPU
  compiled         a torch.compile'd (Inductor/Triton) model trained twice from the same seed, under the recipe:
                   identical fingerprints, or the first parameter that differs

Without a CUDA device every section is skipped (exit status 0): the script itself is tested on CPU.
Timing follows bench/ practice: variants interleaved round by round, medians of per-round ratios, [min..max].
The last lines are the figures, one per line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

# cuBLAS reads it when CUDA starts: set it first, so that the recipe of the last section is in time
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex32, torch.complex64, torch.complex128,
]


class CheckFailed(Exception):
    """A determinism or equality check did not hold."""


def sync() -> None:
    torch.cuda.synchronize()


@contextmanager
def torch_deterministic(on: bool):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def interleaved(fns: dict[str, tuple[Callable[[], object], bool]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each (function, under torch's deterministic mode), interleaved round by round."""
    for fn, det in fns.values():
        with torch_deterministic(det):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, det) in fns.items():
            with torch_deterministic(det):
                sync()
                start = time.perf_counter()
                fn()
                sync()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], name: str, base: str) -> str:
    r = [a / b for a, b in zip(times[name], times[base], strict=True)]
    return f"{statistics.median(r):.2f}x [{min(r):.2f}..{max(r):.2f}]"


def random_bits(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def check_fingerprints(quick: bool) -> list[str]:
    from detrace.digest import fingerprint

    figures = []
    for scheme in ("fp1", "fp2"):
        equal = []
        for i, dtype in enumerate(DTYPES):
            for numel in (1, 1000, 3 * 2**20 + 7):
                t = random_bits(numel, dtype, seed=i)
                for chunks in (None, 4):
                    if chunks is not None and numel < 4:
                        continue
                    cpu = fingerprint(t, chunks=chunks, scheme=scheme)
                    cuda = fingerprint(t.cuda(), chunks=chunks, scheme=scheme)
                    if cpu != cuda:
                        raise CheckFailed(f"{scheme} {dtype} numel {numel} chunks {chunks}: CUDA {cuda.hex} != CPU "
                                          f"{cpu.hex}")
            equal.append(str(dtype).removeprefix("torch."))
        figures.append(f"{scheme} fingerprint cuda == cpu: {len(equal)}/{len(DTYPES)} dtypes (sizes 1, 1000, 3Mi+7; "
                       "whole and 4 chunks)")
    return figures


def check_throughput(quick: bool) -> list[str]:
    from detrace.digest import fingerprint

    figures = []
    for dtype in (torch.float32, torch.bfloat16):
        mib = 256
        x = torch.randn(mib * 2**20 // torch.empty((), dtype=dtype).element_size(), device="cuda").to(dtype)
        fns = {"fp2": (lambda x=x: fingerprint(x, scheme="fp2"), False),
               "fp1": (lambda x=x: fingerprint(x, scheme="fp1"), False),
               "hash_tensor": (lambda x=x: torch.hash_tensor(x), False), "copy": (lambda x=x: x.clone(), False),
               "sum": (lambda x=x: x.sum(), False)}
        times = interleaved(fns, 5 if quick else 11)
        name = str(dtype).removeprefix("torch.")
        speeds = ", ".join(f"{k} {mib / 1024 / statistics.median(v):.0f} GiB/s" for k, v in times.items())
        figures.append(f"cuda {name} {mib}MiB: {speeds}")
        for scheme in ("fp2", "fp1"):
            for base in ("hash_tensor", "copy", "sum"):
                figures.append(f"cuda {scheme} time / {base} {name}: {ratio(times, scheme, base)}")
        del x
    return figures


def _same_bits(label: str, runs: list[torch.Tensor]) -> None:
    for other in runs[1:]:
        if not torch.equal(runs[0], other):
            raise CheckFailed(f"{label}: the bits differ between runs or tile shapes")


def check_kernels(quick: bool) -> list[str]:
    from detrace.ops import _triton, combine, grouped_mm, index_put_, permute, route

    figures = []
    rounds = 5 if quick else 11
    n, k, d, e = (8192, 4, 512, 16) if quick else (32768, 4, 1024, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    choice = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=-1).indices
    r = route(choice, e)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, d, device="cuda", generator=g).to(dtype).requires_grad_()
        w = torch.rand(n, k, device="cuda", generator=g).to(dtype).requires_grad_()
        results = {}
        for backend in ("torch", "triton"):
            x.grad = w.grad = None
            y = combine(torch.tanh(permute(x, r, backend=backend)), r, w, backend=backend)
            y.backward(torch.cos(y))
            results[backend] = [y.detach(), x.grad, w.grad]
        for a, b in zip(results["torch"], results["triton"], strict=True):
            if not torch.equal(a, b):
                raise CheckFailed(f"{dtype}: the Triton permute/combine differ from the PyTorch path")
        figures.append(f"triton permute/combine {str(dtype).removeprefix('torch.')}: bit-equal to the PyTorch path")
    out = torch.randn(n * k, d, device="cuda", generator=g)
    weights = torch.rand(n, k, device="cuda", generator=g)
    scaled = out * weights.flatten()[r.order].unsqueeze(-1)
    _same_bits("combine", [combine(out, r, weights) for _ in range(3)])
    _same_bits("gather_sum tiles", [_triton.gather_sum(out, r.rows, k, weights, block_d=b) for b in (64, 128, 256)])
    tokens = r.tokens
    racing = [torch.zeros(n, d, device="cuda").index_add_(0, tokens, scaled) for _ in range(3)]
    raced = sum(not torch.equal(racing[0], o) for o in racing[1:])
    figures.append(f"racing index_add_ (atomics): {raced}/2 repeats differ from the first; detrace combine: 0/2")
    times = interleaved({
        "atomics": (lambda: torch.zeros(n, d, device="cuda").index_add_(0, tokens, scaled), False),
        "torch-det": (lambda: torch.zeros(n, d, device="cuda").index_add_(0, tokens, scaled), True),
        "detrace": (lambda: combine(out, r, weights), False),
    }, rounds)
    figures.append(f"combine N={n} k={k} D={d} time vs atomics: torch-det {ratio(times, 'torch-det', 'atomics')}, "
                   f"detrace {ratio(times, 'detrace', 'atomics')}")
    xg = torch.randn(n, d, device="cuda", generator=g, requires_grad=True)
    gr = torch.randn(n * k, d, device="cuda", generator=g)

    def gather_bwd() -> None:
        xg.grad = None
        xg[tokens].backward(gr)

    def permute_bwd() -> None:
        xg.grad = None
        permute(xg, r).backward(gr)

    times = interleaved({"atomics": (gather_bwd, False), "torch-det": (gather_bwd, True),
                         "detrace": (permute_bwd, False)}, rounds)
    figures.append(f"permute backward time vs atomics: torch-det {ratio(times, 'torch-det', 'atomics')}, "
                   f"detrace {ratio(times, 'detrace', 'atomics')}")
    _same_bits("index_put", [index_put_(torch.zeros(n, d, device="cuda"), [tokens], scaled, True) for _ in range(3)])
    skewed = torch.randint(0, 64, (n * k,), device="cuda", generator=g)  # indices that repeat a lot
    for label, idx in (("tokens", tokens), ("64 hot rows", skewed)):
        rows = n if label == "tokens" else 64
        times = interleaved({
            "atomics": (lambda idx=idx, rows=rows: torch.zeros(rows, d, device="cuda").index_put_(
                (idx,), scaled, accumulate=True), False),
            "torch-det": (lambda idx=idx, rows=rows: torch.zeros(rows, d, device="cuda").index_put_(
                (idx,), scaled, accumulate=True), True),
            "detrace": (lambda idx=idx, rows=rows: index_put_(torch.zeros(rows, d, device="cuda"), [idx], scaled,
                                                              True), False),
        }, rounds)
        figures.append(f"index_put accumulate ({label}) time vs atomics: torch-det "
                       f"{ratio(times, 'torch-det', 'atomics')}, detrace {ratio(times, 'detrace', 'atomics')}")
    counts = r.counts.tolist()
    for dtype in (torch.float32, torch.bfloat16):
        xs = torch.randn(n * k, d, device="cuda", generator=g).to(dtype)
        wt = (torch.randn(e, 2 * d, d, device="cuda", generator=g) * d**-0.5).to(dtype)
        gy = torch.randn(n * k, 2 * d, device="cuda", generator=g).to(dtype)
        name = str(dtype).removeprefix("torch.")
        _same_bits(f"grouped_mm {name}", [_triton.grouped_mm(xs, wt, counts, block_m=bm, block_n=bn)
                                          for bm, bn in ((64, 64), (64, 64), (32, 128), (128, 32))])
        _same_bits(f"grouped wgrad {name}", [_triton.grouped_wgrad(gy, xs, counts, block_o=bo, block_i=bi)
                                             for bo, bi in ((32, 32), (32, 32), (64, 32), (32, 64))])
        a, b = xs.clone().requires_grad_(), wt.clone().requires_grad_()

        def grouped(backend: str, a: torch.Tensor = a, b: torch.Tensor = b, gy: torch.Tensor = gy) -> None:
            a.grad = b.grad = None
            grouped_mm(a, b, counts, backend=backend).backward(gy)

        times = interleaved({"cublas": (lambda: grouped("torch"), False),
                             "detrace": (lambda: grouped("triton"), False)}, rounds)
        figures.append(f"grouped GEMM fwd+bwd {name}: identical across runs and tiles; time vs per-expert cuBLAS "
                       f"{ratio(times, 'detrace', 'cublas')} (splits {_triton.wgrad_splits(n * k, e)})")
    return figures


def _small_step(device: str, compiled: bool = False,
                preset: str = "small") -> tuple[Callable[[], None], torch.nn.Module]:
    from detrace.workload.model import PRESETS, HybridLM, ModelConfig, objective

    config = PRESETS[preset]["model"]
    assert isinstance(config, ModelConfig)
    batch, seq = int(PRESETS[preset]["batch_size"]), int(PRESETS[preset]["seq_len"])  # type: ignore[call-overload]
    torch.manual_seed(0)
    model = HybridLM(ModelConfig(**{**config.__dict__, "dispatch": "fixed"})).to(device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 2), generator=gen).to(device)
        loss = objective(config, run(tokens[:, :seq]), tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, model


def check_overhead(quick: bool) -> list[str]:
    import detrace

    step, _ = _small_step("cuda")
    rungs = ("metrics", "semantic", "module", "op")
    ratios: dict[str, list[float]] = {rung: [] for rung in rungs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(2 if quick else 3):
            medians = {}
            for variant in ("untraced", *rungs):
                ctx = detrace.trace(Path(tmp) / f"{repeat}-{variant}", rung=variant) if variant != "untraced" else None
                times = []
                if ctx is not None:
                    ctx.__enter__()
                try:
                    for i in range(4):
                        sync()
                        start = time.perf_counter()
                        step()
                        sync()
                        if i:
                            times.append(time.perf_counter() - start)
                finally:
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
                medians[variant] = statistics.median(times)
            for rung in rungs:
                ratios[rung].append(medians[rung] / medians["untraced"])
    return [f"cuda overhead small {rung}: {statistics.median(r):.3f}x [{min(r):.3f}..{max(r):.3f}]"
            for rung, r in ratios.items()]


def check_compiled(quick: bool) -> list[str]:
    import detrace
    from detrace.digest import fingerprint_many

    detrace.deterministic(0, strict=False)
    runs = []
    for _ in range(2):
        step, model = _small_step("cuda", compiled=True, preset="tiny")
        for _ in range(3):
            step()
        sync()
        runs.append((list(dict(model.named_parameters())), fingerprint_many(list(model.parameters()))))
    names, first = runs[0]
    differ = [name for name, a, b in zip(names, first, runs[1][1], strict=True) if a != b]
    if differ:
        raise CheckFailed(f"compiled tiny model, 3 steps twice under the recipe: {len(differ)} parameters differ, "
                          f"first {differ[0]}")
    return [f"compiled (Inductor/Triton) tiny model, 3 steps twice under the recipe: all {len(names)} parameters "
            "identical"]


SECTIONS: tuple[tuple[str, Callable[[bool], list[str]]], ...] = (
    ("fingerprints", check_fingerprints),
    ("throughput", check_throughput),
    ("kernels", check_kernels),
    ("overhead", check_overhead),
    ("compiled", check_compiled),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        for name, _ in SECTIONS:
            print(f"skipped {name}: no CUDA device")
        print("GPU figures: not measured (no CUDA device here)")
        return 0
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    figures, failed = [], []
    start = time.perf_counter()
    for name, check in SECTIONS:
        began = time.perf_counter()
        try:
            lines = check(args.quick)
        except CheckFailed as exc:
            failed.append(name)
            lines = [f"FAILED {name}: {exc}"]
        except Exception as exc:  # one broken section must not hide the others' figures
            failed.append(name)
            lines = [f"ERROR {name}: {type(exc).__name__}: {exc}"]
        for line in lines:
            print(line, flush=True)
        figures += lines
        print(f"({name}: {time.perf_counter() - began:.0f} s)", flush=True)
    print(f"gpu_check: {time.perf_counter() - start:.0f} s, {len(failed)} section(s) failed {failed or ''}")
    print("\n".join(figures))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
