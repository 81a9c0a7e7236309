"""detrace.ops against the racing path and torch's deterministic mode: per op and per training step.

Three ways to run the same computation, measured side by side in one process, interleaved round by round
(so machine load hits them alike); each figure is the median over rounds of the per-round ratio to the
racing/nondeterministic baseline, with the spread (min..max over rounds):

ops (N tokens, k choices, D wide; CPU):
  combine         weight, then index_put(accumulate), racing | the same under torch's deterministic mode |
                  detrace.ops.combine
  permute bwd     backward of x[tokens] racing | torch deterministic | detrace.ops.permute's backward
  grouped GEMM    per-expert F.linear loop fwd+bwd | (deterministic already) | detrace.ops.grouped_mm
  index_put acc   racing | torch deterministic | detrace.ops.index_put_
steps:
  small           HybridLM `small` preset: --dispatch index racing | index under torch's switch | --dispatch fixed
  hf mixtral      tiny Mixtral (8 experts, top-2, 1024 tokens/step): experts "grouped_mm" | "eager" | "detrace"

The last lines are the figures, one per line, e.g. `step small fixed/index: 0.97x [0.95..0.99]`.

    python bench/kernels.py [--rounds 5] [--threads 2] [--skip-ops] [--skip-small] [--skip-hf]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Variant = tuple[str, Callable[[], object], bool]  # (name, function, under torch's deterministic mode)


@contextmanager
def torch_deterministic(on: bool) -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def interleaved(variants: list[Variant], rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, per round (median of `calls` calls), after one warm-up call each."""
    for _, fn, det in variants:
        with torch_deterministic(det):
            fn()
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(rounds):
        for name, fn, det in variants:
            with torch_deterministic(det):
                samples = []
                for _ in range(calls):
                    start = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - start)
            times[name].append(statistics.median(samples))
    return times


def ratio_line(label: str, times: dict[str, list[float]], name: str, base: str) -> str:
    ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
    return (f"{label} {name}/{base}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}] "
            f"({statistics.median(times[name]) * 1e3:.2f} ms vs {statistics.median(times[base]) * 1e3:.2f} ms)")


def op_variants(n: int, k: int, d: int, experts: int) -> dict[str, list[Variant]]:
    from detrace.ops import combine, grouped_mm, index_put_, permute, route

    g = torch.Generator().manual_seed(0)
    choice = torch.rand(n, experts, generator=g).topk(k, dim=-1).indices
    r = route(choice, experts)
    tokens = r.tokens
    out = torch.randn(n * k, d, generator=g)
    weights = torch.rand(n, k, generator=g)
    scaled = out * weights.flatten()[r.order].unsqueeze(-1)
    x = torch.randn(n, d, generator=g, requires_grad=True)
    grad = torch.randn(n * k, d, generator=g)
    counts = r.counts.tolist()
    w = torch.randn(experts, 2 * d, d, generator=g, requires_grad=True)
    xs = torch.randn(n * k, d, generator=g, requires_grad=True)
    gy = torch.randn(n * k, 2 * d, generator=g)

    def gather_backward() -> None:
        x.grad = None
        x[tokens].backward(grad)

    def permute_backward() -> None:
        x.grad = None
        permute(x, r).backward(grad)

    def linear_loop() -> None:
        y = torch.cat([torch.nn.functional.linear(a, w[e]) for e, a in enumerate(xs.split(counts))])
        y.backward(gy)

    def grouped() -> None:
        grouped_mm(xs, w, counts).backward(gy)

    def racing_put() -> torch.Tensor:
        return torch.zeros(n, d).index_put_((tokens,), scaled, accumulate=True)

    def racing_combine() -> torch.Tensor:  # the workload's "index" combine: weight, then accumulate
        return torch.zeros(n, d).index_put_((tokens,), out * weights.flatten()[r.order].unsqueeze(-1), accumulate=True)

    return {
        "combine": [("racing", racing_combine, False), ("torch-det", racing_combine, True),
                    ("detrace", lambda: combine(out, r, weights), False)],
        "permute-bwd": [("racing", gather_backward, False), ("torch-det", gather_backward, True),
                        ("detrace", permute_backward, False)],
        "grouped-gemm": [("racing", linear_loop, False), ("torch-det", linear_loop, True),
                         ("detrace", grouped, False)],
        "index_put": [("racing", racing_put, False), ("torch-det", racing_put, True),
                      ("detrace", lambda: index_put_(torch.zeros(n, d), [tokens], scaled, True), False)],
    }


def small_step(dispatch: str) -> Callable[[], None]:
    from detrace.workload.model import PRESETS, HybridLM, ModelConfig, objective

    preset = PRESETS["small"]
    config = preset["model"]
    assert isinstance(config, ModelConfig)
    config = ModelConfig(**{**config.__dict__, "dispatch": dispatch})
    batch, seq = int(preset["batch_size"]), int(preset["seq_len"])  # type: ignore[call-overload]
    torch.manual_seed(0)
    model = HybridLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 2), generator=gen)
        loss = objective(config, model(tokens[:, :seq]), tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def mixtral_step(implementation: str, tokens: int = 1024) -> Callable[[], None]:
    from transformers import MixtralConfig, MixtralForCausalLM

    from detrace.ops import hf_experts as hf

    hf.register()
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=512)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batch, seq = tokens // 256, 256

    def step() -> None:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens N of the op benchmarks")
    parser.add_argument("--skip-ops", action="store_true", help="leave out the op benchmarks")
    parser.add_argument("--skip-small", action="store_true", help="leave out the small-preset training step")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the HF Mixtral training step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    figures = []
    for op, variants in ({} if args.skip_ops else op_variants(args.tokens, 4, 256, 16)).items():
        times = interleaved(variants, args.rounds, calls=5)
        figures += [ratio_line(f"op {op}", times, name, "racing") for name in ("torch-det", "detrace")]
        print(figures[-1], flush=True)
    if not args.skip_small:
        index, fixed = small_step("index"), small_step("fixed")
        times = interleaved([("index", index, False), ("index-torch-det", index, True), ("fixed", fixed, False)],
                            args.rounds, calls=1)
        figures += [ratio_line("step small", times, name, "index") for name in ("index-torch-det", "fixed")]
        print(figures[-1], flush=True)
    if not args.skip_hf:
        steps = {name: mixtral_step(name) for name in ("grouped_mm", "eager", "detrace")}
        times = interleaved([(name, fn, False) for name, fn in steps.items()], args.rounds, calls=1)
        figures += [ratio_line("step hf-mixtral", times, name, "grouped_mm") for name in ("eager", "detrace")]
    print(f"threads {args.threads}, {args.rounds} rounds, ops at N={args.tokens} k=4 D=256 E=16; "
          "ratio: median of per-round ratios [min..max]")
    for line in figures:
        print(line)


if __name__ == "__main__":
    main()
