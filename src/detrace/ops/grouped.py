"""Grouped GEMM over expert-sorted rows, with a deterministic forward, input gradient and weight gradient.

`grouped_mm(x, weight, counts)`: x [R, in] holds counts[e] consecutive rows for expert e; weight [E, out, in]
(the layout of `nn.Linear`, stacked); the result is [R, out], rows of expert e times weight[e].T. A weight
[S, E, out, in] has S sets of the E experts (groups s E + e, set-major): expert parallelism's one view of the
local experts per source rank, `expand`ed (no copy), whose weight gradient keeps each source's apart. The PyTorch
path runs all the groups in one call; the Triton path one call per set (the bits of each set alone).

- forward and input gradient (dgrad): each output row belongs to one expert's GEMM; no row has two writers.
- weight gradient (wgrad): weight.grad[e] = grad[rows of e].T @ x[rows of e], a reduction over the expert's
  tokens. The PyTorch path makes it one GEMM per expert (the BLAS reduces inside one call). The Triton path
  cuts the token axis into `wgrad_splits(R, E)` private partial slots, a number that depends only on the
  shapes (never on the device's SM count or on timing), and adds the partials in split order.

Experts with no rows get a zero weight gradient and produce no rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from detrace.errors import UsageError
from detrace.ops.moe import Backend, _use_triton


def _offsets(counts: list[int]) -> list[int]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def group_weight(weight: torch.Tensor, g: int) -> torch.Tensor:
    """Group g's [out, in] matrix of a weight [E, out, in] or [S, E, out, in] (a view)."""
    return weight[g] if weight.dim() == 3 else weight[divmod(g, weight.shape[1])]


def _forward(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ weight[e].T, one GEMM per expert."""
    out = x.new_empty(x.shape[0], weight.shape[-2])
    offsets = _offsets(counts)
    for e in range(len(counts)):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            torch.mm(x[lo:hi], group_weight(weight, e).t(), out=out[lo:hi])
    return out


def _dgrad(grad: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = grad.new_empty(grad.shape[0], weight.shape[-1])
    offsets = _offsets(counts)
    for e in range(len(counts)):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            torch.mm(grad[lo:hi], group_weight(weight, e), out=out[lo:hi])
    return out


def _wgrad(grad: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[len(counts), out, in]: grad[rows of e].T @ x[rows of e], one GEMM per expert."""
    out = grad.new_empty(len(counts), grad.shape[1], x.shape[1])
    offsets = _offsets(counts)
    for e in range(len(counts)):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            torch.mm(grad[lo:hi].t(), x[lo:hi], out=out[e])
        else:
            out[e].zero_()
    return out


def _by_set(fn: Any, rows: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> list[Any]:
    """`fn(rows of set s, other's rows of set s, weight[s], counts of set s)` for each set s of a weight [S, E, ...]:
    the Triton kernels index a 3-D weight, and each set's own call keeps the bits of that set alone (its weight
    gradient's partial slots depend on the call's rows and experts) without copying the sets into one weight."""
    per = weight.shape[1]
    results, lo = [], 0
    for s in range(weight.shape[0]):
        mine = counts[s * per:(s + 1) * per]
        hi = lo + sum(mine)
        results.append(fn(rows[lo:hi], other[lo:hi], weight[s], mine))
        lo = hi
    return results


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int], backend: Backend) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.triton = counts, _use_triton(x, backend)
        if ctx.triton:
            from detrace.ops import _triton

            if weight.dim() == 4:
                return torch.cat(_by_set(lambda r, _, w, c: _triton.grouped_mm(r, w, c), x, x, weight, counts))
            return _triton.grouped_mm(x, weight, counts)
        return _forward(x, weight, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.triton:
            from detrace.ops import _triton

            if weight.dim() == 4:
                if ctx.needs_input_grad[0]:
                    grad_x = torch.cat(_by_set(lambda g, _, w, c: _triton.grouped_mm(g, w.transpose(1, 2), c),
                                               grad, grad, weight, ctx.counts))
                if ctx.needs_input_grad[1]:
                    grad_w = torch.stack(_by_set(lambda g, r, _, c: _triton.grouped_wgrad(g, r, c), grad, x, weight,
                                                 ctx.counts))
            else:
                if ctx.needs_input_grad[0]:
                    grad_x = _triton.grouped_mm(grad, weight.transpose(1, 2), ctx.counts)
                if ctx.needs_input_grad[1]:
                    grad_w = _triton.grouped_wgrad(grad, x, ctx.counts)
        else:
            if ctx.needs_input_grad[0]:
                grad_x = _dgrad(grad, weight, ctx.counts)
            if ctx.needs_input_grad[1]:
                grad_w = _wgrad(grad, x, ctx.counts)
        return grad_x, None if grad_w is None else grad_w.view(weight.shape), None, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor, *,
               backend: Backend = "auto") -> torch.Tensor:
    """x [R, in] (counts[e] rows per expert, in expert order) times weight[e].T ([E, out, in], or [S, E, out, in]:
    S sets of experts, groups set-major) -> [R, out]."""
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    if weight.dim() not in (3, 4) or x.dim() != 2 or x.shape[1] != weight.shape[-1]:
        raise UsageError(f"grouped_mm needs x [R, in] and weight [E, out, in] or [S, E, out, in], not "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    groups = math.prod(weight.shape[:-2])
    if len(counts) != groups or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise UsageError(f"counts {counts} must give a non-negative row count for each of the {groups} "
                         f"experts, {x.shape[0]} rows in all")
    return _GroupedMM.apply(x, weight, counts, backend)
