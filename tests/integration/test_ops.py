"""detrace.ops on CPU (PyTorch path): fixed-order MoE permute/combine, grouped GEMM, deterministic index
accumulation and its torch.library routing. The Triton kernels are tested in test_ops_triton.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from detrace.errors import UsageError
from detrace.ops import combine, grouped_mm, index_add, index_put_, permute, route, scatter_add
from detrace.ops import routing as ops_routing
from detrace.ops.moe import fixed_sum


@pytest.fixture(autouse=True)
def _restore_torch_settings() -> Iterator[None]:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    ops_routing.uninstall()


def _moe_inputs(n: int = 96, k: int = 4, e: int = 6, d: int = 40, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(n, e, generator=g).topk(k, dim=-1).indices
    x = torch.randn(n, d, generator=g).to(dtype)
    weights = torch.rand(n, k, generator=g).to(dtype)
    return x, experts, weights


def _moe_step(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, e: int) -> list[torch.Tensor]:
    """permute, a per-row nonlinearity, combine; forward and both gradients."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    r = route(experts, e)
    y = combine(torch.tanh(permute(x, r)) * 1.5, r, weights)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return [y.detach(), x.grad, weights.grad]


def test_permute_and_combine_compute_the_index_dispatch() -> None:
    x, experts, weights = _moe_inputs(dtype=torch.float64)
    r = route(experts, 6)
    order = experts.flatten().argsort(stable=True)
    assert torch.equal(r.order, order) and torch.equal(r.counts, torch.bincount(experts.flatten(), minlength=6))
    assert torch.equal(permute(x, r), x[order // 4])  # a gather: exact
    out = torch.randn(x.shape[0] * 4, x.shape[1], dtype=torch.float64)
    reference = torch.zeros_like(x).index_add_(0, order // 4, out * weights.flatten()[order].unsqueeze(-1))
    torch.testing.assert_close(combine(out, r, weights), reference)
    small = route(experts[:10], 6)
    assert torch.autograd.gradcheck(lambda a, w: combine(permute(a, small).sin(), small, w),
                                    (x[:10, :3].clone().requires_grad_(), weights[:10].clone().requires_grad_()))


def test_combine_sums_in_choice_order_starting_from_the_first_term() -> None:
    x, experts, weights = _moe_inputs()
    r = route(experts, 6)
    out = torch.randn(x.shape[0] * 4, x.shape[1])
    out[r.rows[0]] = -0.0  # token 0's first choice: -0.0 + -0.0 must stay -0.0
    out[r.rows[1:4]] = -0.0
    slots = out[r.rows].view(-1, 4, x.shape[1])
    expected = slots[:, 0] * weights[:, :1]
    for j in range(1, 4):
        expected = expected + slots[:, j] * weights[:, j : j + 1]
    got = combine(out, r, weights)
    assert torch.equal(got, expected)
    assert torch.signbit(got[0]).all()
    assert torch.equal(fixed_sum(slots), ((slots[:, 0] + slots[:, 1]) + slots[:, 2]) + slots[:, 3])


def test_moe_bits_do_not_depend_on_the_thread_count() -> None:
    x, experts, weights = _moe_inputs(n=2048, d=64)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(_moe_step(x, experts, weights, 6))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_moe_bits_of_a_token_do_not_depend_on_the_rest_of_the_batch() -> None:
    x, experts, weights = _moe_inputs(n=64)
    x2, experts2, weights2 = _moe_inputs(n=64, seed=1)
    # the first 32 tokens again, now batched with 32 others (placed first, so every row moves)
    mixed = [torch.cat([b[32:], a[:32]]) for a, b in ((x, x2), (experts, experts2), (weights, weights2))]
    alone, together = _moe_step(x[:32], experts[:32], weights[:32], 6), _moe_step(*mixed, 6)
    # the output gradient differs between batches only by position: give the same rows the same gradient
    for a, b in zip(alone, together, strict=True):
        assert a.shape[0] == 32 and b.shape[0] == 64
    x_a = x[:32].clone().requires_grad_()
    w_a = weights[:32].clone().requires_grad_()
    r = route(experts[:32], 6)
    y_a = combine(permute(x_a, r) * 2, r, w_a)
    y_a.backward(torch.ones_like(y_a))
    x_b = mixed[0].clone().requires_grad_()
    w_b = mixed[2].clone().requires_grad_()
    r = route(mixed[1], 6)
    y_b = combine(permute(x_b, r) * 2, r, w_b)
    y_b.backward(torch.ones_like(y_b))
    assert torch.equal(y_a, y_b[32:]) and torch.equal(x_a.grad, x_b.grad[32:]) and torch.equal(w_a.grad, w_b.grad[32:])


def test_bfloat16_sums_in_float32_and_rounds_once() -> None:
    x, experts, weights = _moe_inputs(dtype=torch.bfloat16)
    r = route(experts, 6)
    out = torch.randn(x.shape[0] * 4, x.shape[1]).to(torch.bfloat16)
    expected = fixed_sum(out.float()[r.rows].view(-1, 4, x.shape[1]), weights.float()).to(torch.bfloat16)
    assert torch.equal(combine(out, r, weights), expected)


def test_moe_shape_errors_are_usage_errors() -> None:
    x, experts, weights = _moe_inputs()
    r = route(experts, 6)
    with pytest.raises(UsageError, match="x must be"):
        permute(x[:5], r)
    with pytest.raises(UsageError, match="out must be"):
        combine(x, r)
    with pytest.raises(UsageError, match="weights has"):
        combine(permute(x, r), r, weights[:3])
    with pytest.raises(UsageError, match="experts must be"):
        route(experts.flatten(), 6)


def _grouped_reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(x.split(counts))])


def test_grouped_mm_forward_and_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 9, 3]
    x = torch.randn(17, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    out = grouped_mm(x, w, counts)
    torch.testing.assert_close(out, _grouped_reference(x, w, counts))
    out.backward(torch.ones_like(out))
    assert torch.equal(w.grad[1], torch.zeros(7, 6, dtype=torch.float64))  # no rows: a zero gradient
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, torch.tensor(counts)), (x, w))


def test_grouped_mm_is_bit_identical_across_runs() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    counts = [300, 17, 0, 211]
    x = torch.randn(sum(counts), 64, generator=g)
    w = torch.randn(4, 48, 64, generator=g)
    runs = []
    for _ in range(3):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = grouped_mm(a, b, counts)
        out.backward(torch.cos(out))
        runs.append((out, a.grad, b.grad))
    for run in runs[1:]:
        assert all(torch.equal(p, q) for p, q in zip(runs[0], run, strict=True))


def test_grouped_mm_over_sets_of_experts_is_each_set_alone() -> None:
    """A weight [S, E, out, in] (an expand: S views of the same experts, no copy) runs S sets of groups in one call:
    outputs, input gradients and each set's weight gradient have the bits of the set's own call."""
    g = torch.Generator().manual_seed(1)
    counts = [[7, 0, 12], [3, 9, 1]]
    x = torch.randn(32, 16, generator=g)
    w = torch.randn(3, 24, 16, generator=g)
    back = torch.randn(32, 24, generator=g)
    sets = w.expand(2, 3, 24, 16).requires_grad_()
    xs = x.clone().requires_grad_()
    out = grouped_mm(xs, sets, counts[0] + counts[1])
    out.backward(back)
    assert sets.grad.shape == (2, 3, 24, 16)  # type: ignore[union-attr]
    lo = 0
    for s, c in enumerate(counts):
        hi = lo + sum(c)
        xa, wa = x[lo:hi].clone().requires_grad_(), w.clone().requires_grad_()
        alone = grouped_mm(xa, wa, c)
        alone.backward(back[lo:hi])
        assert torch.equal(out[lo:hi], alone) and torch.equal(xs.grad[lo:hi], xa.grad)  # type: ignore[index]
        assert torch.equal(sets.grad[s], wa.grad)  # type: ignore[index]
        lo = hi
    with pytest.raises(UsageError, match="each of the 6 experts"):
        grouped_mm(x, sets, [32])


def test_grouped_mm_errors() -> None:
    x, w = torch.randn(5, 3), torch.randn(2, 4, 3)
    with pytest.raises(UsageError, match="counts"):
        grouped_mm(x, w, [2, 2])
    with pytest.raises(UsageError, match="counts"):
        grouped_mm(x, w, [6, -1])
    with pytest.raises(UsageError, match="weight"):
        grouped_mm(x, w[0], [5])


def _torch_deterministic(fn):
    torch.use_deterministic_algorithms(True)
    try:
        return fn()
    finally:
        torch.use_deterministic_algorithms(False)


def test_index_accumulation_is_bit_equal_to_torchs_deterministic_cpu_loop() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50, 7, generator=g)
    idx = torch.randint(-50, 50, (400,), generator=g)
    values = torch.randn(400, 7, generator=g)
    expected = _torch_deterministic(lambda: base.clone().index_put_((idx,), values, accumulate=True))
    assert torch.equal(index_put_(base.clone(), [idx], values, True), expected)
    cols = torch.randint(0, 7, (400,), generator=g)
    expected = _torch_deterministic(lambda: base.clone().index_put_((idx, cols), values[:, 0], accumulate=True))
    assert torch.equal(index_put_(base.clone(), [idx, cols], values[:, 0], True), expected)
    noncontiguous = base.clone().t()  # [7, 50] strided (clone keeps the strides)
    rows = torch.randn(400, 50, generator=g)
    expected = _torch_deterministic(lambda: noncontiguous.clone().index_put_((cols,), rows, accumulate=True))
    got = noncontiguous.clone()
    assert not got.is_contiguous()
    index_put_(got, [cols], rows, True)
    assert torch.equal(got, expected)
    source = torch.randn(50, 400, generator=g)
    assert torch.equal(index_add(base, 1, cols, source, alpha=0.5), base.index_add(1, cols, source, alpha=0.5))
    scatter_index = torch.randint(0, 50, (40, 5), generator=g)
    assert torch.equal(scatter_add(base, 0, scatter_index, values), base.scatter_add(0, scatter_index, values))


def test_integer_accumulation_is_exact() -> None:
    big = torch.full((3,), 2**40, dtype=torch.int64)
    got = index_put_(big.clone(), [torch.tensor([0, 0, 2])], torch.tensor([1, 2, 3]), True)
    assert got.tolist() == [2**40 + 3, 2**40, 2**40 + 3]


def test_index_put_without_accumulate_lets_the_last_writer_win() -> None:
    base = torch.zeros(6)
    got = index_put_(base.clone(), [torch.tensor([1, 4, 1, 1])], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert got.tolist() == [0.0, 4.0, 0.0, 0.0, 2.0, 0.0]
    mask = torch.tensor([[True, False], [False, True]])
    got = index_put_(torch.zeros(2, 2), [mask], torch.tensor(7.0))
    assert got.tolist() == [[7.0, 0.0], [0.0, 7.0]]
    got = index_put_(torch.zeros(3, 4), [None, torch.tensor([3, 0])], torch.tensor([[1.0, 2.0]]))
    assert got.tolist() == [[2.0, 0.0, 0.0, 1.0]] * 3


def test_index_errors() -> None:
    with pytest.raises(IndexError, match="out of range"):
        index_put_(torch.zeros(3, 2), [torch.tensor([3])], torch.ones(1, 2), True)
    with pytest.raises(UsageError, match="int64"):
        index_add(torch.zeros(3), 0, torch.tensor([0.5]), torch.ones(1))


def test_routing_sends_torchs_own_calls_to_detrace_and_gives_them_back() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g, requires_grad=True)
    idx = torch.randint(0, 64, (2000,), generator=g)

    def grad_of_gather() -> torch.Tensor:
        x.grad = None
        (x[idx] * torch.arange(16.0)).sum().backward()  # backward: aten._index_put_impl_(accumulate=True)
        return x.grad.clone()

    expected = _torch_deterministic(grad_of_gather)
    assert ops_routing.install(["cpu"]) == ["_index_put_impl_ on cpu", "index_add on cpu", "scatter_add on cpu"]
    calls = []
    original = ops_routing.index.accumulate_rows_

    def counting(*args, **kwargs):
        calls.append(args[1].numel())
        return original(*args, **kwargs)

    ops_routing.index.accumulate_rows_ = counting
    try:
        assert torch.equal(grad_of_gather(), expected)
        assert calls == [2000]
        ones = torch.ones(3)
        assert torch.zeros(4).index_add_(0, torch.tensor([1, 1, 3]), ones).tolist() == [0.0, 2.0, 0.0, 1.0]
        assert torch.zeros(4).scatter_add(0, torch.tensor([2, 2, 2]), ones).tolist() == [0.0, 0.0, 3.0, 0.0]
        out = torch.empty(0)
        torch.index_add(torch.zeros(4), 0, torch.tensor([0]), ones[:1], alpha=2, out=out)
        assert out.tolist() == [2.0, 0.0, 0.0, 0.0]
        assert len(calls) == 4
    finally:
        ops_routing.index.accumulate_rows_ = original
    ops_routing.uninstall()
    assert ops_routing.routed() == []
    torch.zeros(4).index_add_(0, torch.tensor([1]), torch.ones(1))
    assert len(calls) == 4  # torch's own kernel again


_ROUTED_PROBE = """
import sys
import torch
import detrace
from detrace.cli import main
settings = detrace.deterministic(0, kernels="detrace")
print("routed:", ", ".join(settings.routed))
print("setting:", settings.settings["detrace.kernels"])
# the backward of a gather with repeated indices still runs (on CPU through torch's deterministic loop)
x = torch.randn(8, 3, requires_grad=True)
x[torch.tensor([1, 1, 2])].sum().backward()
print("grad:", x.grad[1].tolist())
sys.exit(main(["doctor"]))
"""


def test_deterministic_with_detrace_kernels_routes_and_doctor_lists_it() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}
    done = subprocess.run([sys.executable, "-c", _ROUTED_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "routed: _index_put_impl_ on cuda, index_add on cuda, scatter_add on cuda" in lines
    assert "setting: detrace" in lines and "grad: [2.0, 2.0, 2.0]" in lines
    assert any(line.startswith("ok        detrace.ops aten::index_add on cuda = routed") for line in lines)
    assert any(line.startswith("ok        detrace.ops on cpu = torch  (nothing is routed on cpu") for line in lines)


def test_deterministic_refuses_an_unknown_kernels_choice() -> None:
    from detrace import deterministic

    with pytest.raises(UsageError, match="kernels must be one of torch, detrace"):
        deterministic(0, kernels="fast")


def test_gpu_check_skips_every_section_cleanly_without_cuda() -> None:
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/gpu_check.py would run for minutes")
    script = Path(__file__).parents[2] / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"skipped {name}: no CUDA device" for name in
                     ("fingerprints", "throughput", "kernels", "overhead", "compiled")] + [
        "GPU figures: not measured (no CUDA device here)"]
