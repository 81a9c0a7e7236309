"""detrace.ops' Triton kernels, run on CPU by the Triton interpreter (TRITON_INTERPRET=1): the same fixed
order as the PyTorch path (bit-equal where the order is the same), identical bits across runs and across
block/grid configurations. Sizes are small: the interpreter runs each program in Python.

Skipped only where triton is not installed (the test extras install it)."""

from __future__ import annotations

import pytest
import torch
from _tools import triton_tests

DEVICE, pytestmark = triton_tests()  # before detrace.ops._triton is imported

from detrace.ops import _triton, combine, grouped_mm, permute, route  # noqa: E402
from detrace.ops.index import accumulate_rows_  # noqa: E402
from detrace.ops.moe import fixed_sum  # noqa: E402


def _moe(dtype: torch.dtype, backend: str, block_d: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n, k, e, d = 24, 3, 5, 40
    experts = torch.rand(n, e, generator=g).topk(k, dim=-1).indices.to(DEVICE)
    x = torch.randn(n, d, generator=g).to(DEVICE, dtype).requires_grad_()
    w = torch.rand(n, k, generator=g).to(DEVICE, dtype).requires_grad_()
    r = route(experts, e)
    y = combine(torch.tanh(permute(x, r, backend=backend)), r, w, backend=backend)  # type: ignore[arg-type]
    y.backward(torch.cos(y))
    return [y.detach(), x.grad, w.grad]


def test_moe_kernels_are_bit_equal_to_the_pytorch_path() -> None:
    dtypes = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    for dtype in dtypes:
        for a, b in zip(_moe(dtype, "torch"), _moe(dtype, "triton"), strict=True):
            assert torch.equal(a, b)


def test_bfloat16_sums_run_in_float32_and_round_once() -> None:
    g = torch.Generator().manual_seed(5)
    src = torch.randn(30, 50, generator=g).to(DEVICE, torch.bfloat16)
    rows = torch.randperm(30, generator=g).to(DEVICE)
    weights = torch.rand(10, 3, generator=g).to(DEVICE, torch.bfloat16)
    expected = fixed_sum(src.index_select(0, rows).view(10, 3, 50), weights)
    got = _triton.gather_sum(src, rows, 3, weights)
    if DEVICE == "cpu":
        # the interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest even, as torch does):
        # the float32 sums are the same, the final rounding may differ by one bfloat16 step
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, expected)


def test_moe_kernels_give_the_same_bits_for_every_block_size() -> None:
    g = torch.Generator().manual_seed(1)
    src = torch.randn(30, 50, generator=g).to(DEVICE)
    rows = torch.randperm(30, generator=g).to(DEVICE)
    weights = torch.rand(10, 3, generator=g).to(DEVICE)
    sums = [_triton.gather_sum(src, rows, 3, weights, block_d=b) for b in (16, 32, 64)]
    gathers = [_triton.gather_rows(src, rows, weights.flatten(), block_d=b) for b in (16, 64)]
    assert all(torch.equal(sums[0], s) for s in sums[1:]) and torch.equal(gathers[0], gathers[1])


def test_segmented_accumulation_is_bit_equal_to_the_pytorch_path() -> None:
    g = torch.Generator().manual_seed(2)
    dest = torch.randn(12, 20, generator=g).to(DEVICE)
    index = torch.randint(0, 12, (60,), generator=g).to(DEVICE)
    src = torch.randn(60, 20, generator=g).to(DEVICE)
    expected = accumulate_rows_(dest.clone(), index, src, alpha=0.5, backend="torch")
    assert torch.equal(accumulate_rows_(dest.clone(), index, src, alpha=0.5, backend="triton"), expected)
    order = index.argsort(stable=True)
    targets, counts = torch.unique_consecutive(index[order], return_counts=True)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    for block in (16, 32):
        assert torch.equal(_triton.segment_sum_(dest.clone(), targets, offsets, order, src, 0.5, block_c=block),
                           expected)


def _grouped(counts: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), 40, generator=g).to(DEVICE)
    w = torch.randn(len(counts), 24, 40, generator=g).to(DEVICE)
    grad = torch.randn(sum(counts), 24, generator=g).to(DEVICE)
    return (_triton.grouped_mm(x, w, counts), _triton.grouped_mm(grad, w.transpose(1, 2), counts),
            _triton.grouped_wgrad(grad, x, counts))


def test_grouped_gemm_is_close_to_pytorch_and_identical_across_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "TOKENS_PER_SPLIT", 16)  # small shapes, yet several partial slots per expert
    counts = [90, 0, 13, 97]
    assert _triton.wgrad_splits(sum(counts), len(counts)) == 3
    first, again = _grouped(counts), _grouped(counts)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    # against the PyTorch path (BLAS): the same sums in another order, so float32 rounding apart
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 40, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(len(counts), 24, 40, generator=g).to(DEVICE).requires_grad_()
    grad = torch.randn(sum(counts), 24, generator=g).to(DEVICE)
    out = grouped_mm(x, w, counts, backend="torch")
    out.backward(grad)
    for got, want in zip(first, (out.detach(), x.grad, w.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(first[2][1], torch.zeros(24, 40, device=DEVICE))  # an expert without rows


def test_grouped_gemm_rows_do_not_depend_on_where_their_tiles_start() -> None:
    # expert 2's rows, after 0 or after 37 other rows: other tile boundaries and grid, the same products
    # (tile shapes stay: the interpreter's tl.dot is NumPy's matmul, whose order follows the tile shape;
    # bench/gpu_check.py checks other tile shapes on a GPU)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(50, 40, generator=g).to(DEVICE)
    w = torch.randn(3, 24, 40, generator=g).to(DEVICE)
    alone = _triton.grouped_mm(x[37:], w, [0, 0, 13])
    behind = _triton.grouped_mm(x, w, [30, 7, 13])
    assert torch.equal(alone, behind[37:])


def test_grouped_gemm_autograd_through_triton() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 16, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(2, 16, 16, generator=g).to(DEVICE).requires_grad_()
    out = grouped_mm(x, w, [12, 8], backend="triton")
    out.sum().backward()
    torch.testing.assert_close(out, torch.cat([x[:12] @ w[0].t(), x[12:] @ w[1].t()]))
    torch.testing.assert_close(w.grad[1], torch.ones(16, 8, device=DEVICE) @ x[12:].detach())


def test_grouped_gemm_over_sets_of_experts_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight [S, E, out, in] (`expand`ed) runs each set as its own call would: the same outputs, input gradients
    and weight gradients (whose partial slots depend on the call's rows and experts)."""
    monkeypatch.setattr(_triton, "TOKENS_PER_SPLIT", 8)
    g = torch.Generator().manual_seed(5)
    counts = [[30, 2], [0, 9]]
    x = torch.randn(41, 16, generator=g).to(DEVICE)
    w = torch.randn(2, 24, 16, generator=g).to(DEVICE)
    back = torch.randn(41, 24, generator=g).to(DEVICE)
    sets = w.expand(2, 2, 24, 16).requires_grad_()
    xs = x.clone().requires_grad_()
    out = grouped_mm(xs, sets, counts[0] + counts[1], backend="triton")
    out.backward(back)
    for s, (lo, hi) in enumerate(((0, 32), (32, 41))):
        xa, wa = x[lo:hi].clone().requires_grad_(), w.clone().requires_grad_()
        alone = grouped_mm(xa, wa, counts[s], backend="triton")
        alone.backward(back[lo:hi])
        assert torch.equal(out[lo:hi], alone) and torch.equal(xs.grad[lo:hi], xa.grad)  # type: ignore[index]
        assert torch.equal(sets.grad[s], wa.grad)  # type: ignore[index]


def test_kernels_refuse_float64() -> None:
    with pytest.raises(TypeError, match="float32"):
        _triton.gather_rows(torch.zeros(2, 2, dtype=torch.float64), torch.tensor([0]), None)
