"""Triton kernels of detrace.ops, in the same fixed orders as the PyTorch code.

- `gather_rows`, `gather_sum`, `segment_sum_`: one program per output row (and block of columns); a row's
  terms are added one after another in a fixed order, in float32, starting from the first term. They are
  bit-equal to the PyTorch path. Launched with `enable_fp_fusion=False`: a fused multiply-add would round
  once where PyTorch rounds twice.
- `grouped_mm`, `grouped_wgrad`: tiles of one expert's rows; the reduction axis is walked in steps of
  `BLOCK_K` (`BLOCK_T` for the token axis of wgrad), constants that are part of the order, so BLOCK_M/BLOCK_N
  (and the grid) can change without changing a bit. The weight gradient splits each expert's tokens into
  `wgrad_splits(R, E)` private partial slots (a function of shapes only), added in split order. Their bits
  differ from the BLAS of the PyTorch path (another order of the same sums): tests compare to float tolerance.

Under `TRITON_INTERPRET=1` these kernels run on CPU tensors (how CI tests them without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # reduction step of the grouped GEMM: part of its summation order
BLOCK_T = 32  # token step of the weight gradient: part of its summation order
TOKENS_PER_SPLIT = 256  # the weight gradient cuts each expert's tokens into ~R / (E * this) partial slots
MAX_SPLITS = 16


def _launch_options() -> dict[str, object]:
    # the interpreter has no code generation to configure (and rejects compiler options)
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def _gather_rows_kernel(src, index, scale, out, D, stride_src, stride_out,
                        HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    i = tl.load(index + r)
    v = tl.load(src + i * stride_src + cols, mask=mask).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale + r).to(tl.float32)
    tl.store(out + r * stride_out + cols, v.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(src, rows, weights, out, D, stride_src, stride_out,
                       K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    r = tl.load(rows + n * K)
    acc = tl.load(src + r * stride_src + cols, mask=mask).to(tl.float32)
    if HAS_W:
        acc = acc * tl.load(weights + n * K).to(tl.float32)
    for j in tl.static_range(1, K):  # choice order
        r = tl.load(rows + n * K + j)
        v = tl.load(src + r * stride_src + cols, mask=mask).to(tl.float32)
        if HAS_W:
            v = v * tl.load(weights + n * K + j).to(tl.float32)
        acc = acc + v
    tl.store(out + n * stride_out + cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _segment_sum_kernel(dest, targets, offsets, order, src, alpha, C, stride_dest, stride_src,
                        HAS_ALPHA: tl.constexpr, BLOCK_C: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    t = tl.load(targets + u)
    lo = tl.load(offsets + u)
    hi = tl.load(offsets + u + 1)
    acc = tl.load(dest + t * stride_dest + cols, mask=mask).to(tl.float32)
    for i in range(lo, hi):  # the sources of this row in increasing source order
        s = tl.load(order + i)
        v = tl.load(src + s * stride_src + cols, mask=mask).to(tl.float32)
        if HAS_ALPHA:
            v = v * alpha
        acc = acc + v
    tl.store(dest + t * stride_dest + cols, acc.to(dest.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(x, w, out, tile_expert, tile_start, tile_end, N, K,
                       sxm, sxk, swe, swn, swk, som, son,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_expert + t).to(tl.int64)
    m0 = tl.load(tile_start + t)
    m1 = tl.load(tile_end + t)
    rm = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the reduction in steps of BLOCK_K, in order
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < m1) & (kk[None, :] < K), other=0.0)
        b = tl.load(w + e * swe + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(out + rm[:, None] * som + rn[None, :] * son, acc.to(out.dtype.element_ty),
             mask=(rm[:, None] < m1) & (rn[None, :] < N))


@triton.jit
def _wgrad_kernel(g, x, partial, part_start, part_end, n_out, n_in,
                  sgm, sgo, sxm, sxi, spp, spo, spi,
                  BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    lo = tl.load(part_start + p)
    hi = tl.load(part_end + p)
    ro = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    ri = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    rt = tl.arange(0, BLOCK_T).to(tl.int64)
    acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):  # this partial slot's tokens, in order
        tt = t0 + rt
        a = tl.load(g + tt[None, :] * sgm + ro[:, None] * sgo, mask=(tt[None, :] < hi) & (ro[:, None] < n_out),
                    other=0.0)
        b = tl.load(x + tt[:, None] * sxm + ri[None, :] * sxi, mask=(tt[:, None] < hi) & (ri[None, :] < n_in),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(partial + p * spp + ro[:, None] * spo + ri[None, :] * spi, acc,
             mask=(ro[:, None] < n_out) & (ri[None, :] < n_in))


def _check(t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"detrace.ops' Triton kernels take float32, bfloat16 or float16, not {t.dtype}")


def gather_rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, *,
                block_d: int = 128) -> torch.Tensor:
    """out[r] = src[index[r]] (* scale[r]), as `detrace.ops.moe._gather_rows`."""
    _check(src)
    src = src.contiguous()
    out = src.new_empty(index.numel(), src.shape[1])
    if out.numel():
        scale_arg = scale.contiguous() if scale is not None else src
        grid = (index.numel(), triton.cdiv(src.shape[1], block_d))
        _gather_rows_kernel[grid](src, index.contiguous(), scale_arg, out, src.shape[1], src.stride(0), out.stride(0),
                                  HAS_SCALE=scale is not None, BLOCK_D=block_d, **_launch_options())
    return out


def gather_sum(src: torch.Tensor, rows: torch.Tensor, k: int, weights: torch.Tensor | None, *,
               block_d: int = 128) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * src[rows[n * k + j]] in choice order, as `detrace.ops.moe._gather_sum`."""
    _check(src)
    src = src.contiguous()
    n = rows.numel() // k
    out = src.new_empty(n, src.shape[1])
    if out.numel():
        w_arg = weights.contiguous() if weights is not None else src
        grid = (n, triton.cdiv(src.shape[1], block_d))
        _gather_sum_kernel[grid](src, rows.contiguous(), w_arg, out, src.shape[1], src.stride(0), out.stride(0),
                                 K=k, HAS_W=weights is not None, BLOCK_D=block_d, **_launch_options())
    return out


def segment_sum_(dest: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
                 src: torch.Tensor, alpha: float, *, block_c: int = 128) -> torch.Tensor:
    """dest[targets[u]] += sum of src[order[i]] for i in offsets[u]..offsets[u+1]-1, in that order."""
    _check(dest)
    assert dest.is_contiguous() or dest.stride(-1) == 1
    src = src.contiguous()
    if targets.numel():
        grid = (targets.numel(), triton.cdiv(dest.shape[1], block_c))
        _segment_sum_kernel[grid](dest, targets, offsets, order, src, float(alpha), dest.shape[1], dest.stride(0),
                                  src.stride(0), HAS_ALPHA=alpha != 1.0, BLOCK_C=block_c, **_launch_options())
    return dest


def _tiles(counts: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    experts, starts, ends = [], [], []
    lo = 0
    for e, c in enumerate(counts):
        for m in range(lo, lo + c, block_m):
            experts.append(e)
            starts.append(m)
            ends.append(lo + c)
        lo += c
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (experts, starts, ends))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int], *, block_m: int = 64,
               block_n: int = 64) -> torch.Tensor:
    """x [R, in] (counts[e] rows per expert) times weight[e].T for weight [E, out, in] (any strides)."""
    _check(x)
    out = x.new_empty(x.shape[0], weight.shape[1])
    tile_expert, tile_start, tile_end = _tiles(counts, block_m, x.device)
    if tile_expert.numel() and out.shape[1]:
        grid = (tile_expert.numel(), triton.cdiv(weight.shape[1], block_n))
        _grouped_mm_kernel[grid](x, weight, out, tile_expert, tile_start, tile_end, weight.shape[1], weight.shape[2],
                                 x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
                                 out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                                 **_launch_options())
    return out


def wgrad_splits(rows: int, experts: int) -> int:
    """Partial slots per expert of the weight gradient: a function of the shapes only."""
    return max(1, min(MAX_SPLITS, rows // max(1, experts * TOKENS_PER_SPLIT)))


def grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, counts: list[int], *, block_o: int = 32,
                  block_i: int = 32) -> torch.Tensor:
    """weight.grad [E, out, in]: grad[rows of e].T @ x[rows of e], through private partial slots."""
    _check(x)
    n_experts, splits = len(counts), wgrad_splits(x.shape[0], len(counts))
    starts, ends = [], []
    lo = 0
    for c in counts:
        chunk = -(-c // splits)
        for s in range(splits):
            starts.append(min(lo + s * chunk, lo + c))
            ends.append(min(lo + (s + 1) * chunk, lo + c))
        lo += c
    part_start = torch.tensor(starts, dtype=torch.int64, device=x.device)
    part_end = torch.tensor(ends, dtype=torch.int64, device=x.device)
    n_out, n_in = grad.shape[1], x.shape[1]
    partial = torch.zeros(n_experts * splits, n_out, n_in, dtype=torch.float32, device=x.device)
    if partial.numel():
        grid = (n_experts * splits, triton.cdiv(n_out, block_o), triton.cdiv(n_in, block_i))
        _wgrad_kernel[grid](grad, x, partial, part_start, part_end, n_out, n_in, grad.stride(0), grad.stride(1),
                            x.stride(0), x.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
                            BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_T=BLOCK_T, **_launch_options())
    parts = partial.view(n_experts, splits, n_out, n_in)
    acc = parts[:, 0].clone()
    for s in range(1, splits):  # partial slots added in split order
        acc += parts[:, s]
    return acc.to(x.dtype)
