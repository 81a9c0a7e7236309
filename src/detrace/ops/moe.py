"""MoE permute and unpermute-combine with a known fan-out k, in a fixed reduction order.

Each of the N tokens is routed to k experts: N * k (token, choice) *slots*, slot s = token * k + choice. The
expert-sorted order of the slots is the *routing*: row r of the expert-sorted tensor holds slot `order[r]`.

- `permute(x, routing)`: [N, D] -> [N * k, D], row r = x[token of order[r]]. Its backward sums the k rows
  of each token: every row of the gradient is first read into the token's private slot (a gather), then the
  k slots are added in choice order 0, 1, ..., k - 1.
- `combine(out, routing, weights)`: [N * k, D] -> [N, D], y[n] = sum_j weights[n, j] * out[row of slot
  n * k + j], the same gather into private slots and the same fixed-order sum. Its backward only gathers
  (each row of `out` belongs to one slot) and takes one dot product per slot for the weights' gradient.

Nothing ever adds into a row that another writer also adds into, so the bits do not depend on the thread
count, the launch grid, or the other tokens of the batch. The sum runs in float32 (one rounding at the end for
lower-precision inputs) and starts from the first term (never from 0.0, which would turn -0.0 into +0.0).

On CUDA the gathers and sums run as Triton kernels (`detrace.ops._triton`) in the same order, bit-equal to
the PyTorch code; elsewhere they are PyTorch ops.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import torch

from detrace.errors import UsageError

Backend = Literal["auto", "torch", "triton"]


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Where each (token, choice) slot sits in the expert-sorted order. Build it with `route`."""

    order: torch.Tensor
    """[N * k] int64: the slot held by each expert-sorted row (a permutation of 0..N*k-1)."""
    rows: torch.Tensor
    """[N * k] int64: the expert-sorted row of each slot (the inverse permutation of `order`)."""
    counts: torch.Tensor
    """[E] int64: rows per expert, in expert order."""
    k: int
    """Fan-out: experts per token."""

    @property
    def tokens(self) -> torch.Tensor:
        """[N * k] int64: the token of each expert-sorted row."""
        return self.order // self.k


def route(experts: torch.Tensor, n_experts: int) -> Routing:
    """The routing of `experts` [N, k] (expert id of each choice): a stable sort of the slots by expert, so
    that rows of one expert keep token order."""
    if experts.dim() != 2:
        raise UsageError(f"experts must be [tokens, k], not of shape {tuple(experts.shape)}")
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    # scatter of a permutation: every destination is written once, so no two writers meet
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.bincount(flat, minlength=n_experts)
    return Routing(order=order, rows=rows, counts=counts, k=experts.shape[1])


def _use_triton(t: torch.Tensor, backend: Backend) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    # Triton kernels on CUDA tensors of the dtypes they take, where triton is installed (it comes with torch)
    return (t.device.type == "cuda" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and importlib.util.find_spec("triton") is not None)


def fixed_sum(slots: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[:, j] * slots[:, j] over j = 0, 1, ..., k - 1 in that order, in float32, for slots
    [N, k, D] and weights [N, k] (or all ones): [N, D] in slots' dtype."""
    acc_dtype = torch.promote_types(slots.dtype, torch.float32)
    k = slots.shape[1]
    if weights is None:
        # the first addition makes the accumulator (no copy of the first term)
        acc = slots[:, 0].to(acc_dtype) + slots[:, 1] if k > 1 else slots[:, 0].to(acc_dtype, copy=True)
        for j in range(2, k):
            acc += slots[:, j]
    else:
        w = weights.to(acc_dtype)
        acc = slots[:, 0].to(acc_dtype) * w[:, 0:1]
        for j in range(1, k):
            # two roundings (product, then sum), as the kernels do: no fused multiply-add anywhere
            acc += slots[:, j].to(acc_dtype) * w[:, j : j + 1]
    return acc.to(slots.dtype)


def _gather_sum(src: torch.Tensor, rows: torch.Tensor, k: int, weights: torch.Tensor | None,
                backend: Backend) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * src[rows[n * k + j]], in choice order."""
    if _use_triton(src, backend):
        from detrace.ops import _triton

        return _triton.gather_sum(src, rows, k, weights)
    slots = src.index_select(0, rows).view(-1, k, src.shape[-1])
    return fixed_sum(slots, weights)


def _gather_rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, backend: Backend) -> torch.Tensor:
    """out[r] = src[index[r]] * scale[r] (scale optional): a gather, every output row written once."""
    if _use_triton(src, backend):
        from detrace.ops import _triton

        return _triton.gather_rows(src, index, scale)
    out = src.index_select(0, index)
    if scale is not None:
        out = (out.to(torch.promote_types(out.dtype, torch.float32)) * scale.unsqueeze(-1)).to(src.dtype)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, rows: torch.Tensor, k: int,
                backend: Backend) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.k, ctx.backend = k, backend
        return _gather_rows(x, order // k, None, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (rows,) = ctx.saved_tensors
        return _gather_sum(grad.contiguous(), rows, ctx.k, None, ctx.backend), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, weights: torch.Tensor | None, order: torch.Tensor, rows: torch.Tensor,
                k: int, backend: Backend) -> torch.Tensor:
        ctx.save_for_backward(out, weights, order, rows)
        ctx.k, ctx.backend = k, backend
        return _gather_sum(out, rows, k, None if weights is None else weights.reshape(-1, k), backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out, weights, order, rows = ctx.saved_tensors
        k, backend = ctx.k, ctx.backend
        grad = grad.contiguous()
        flat_w = None if weights is None else weights.reshape(-1).index_select(0, order)
        grad_out = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_out = _gather_rows(grad, order // k, flat_w, backend)  # each row of `out` feeds one slot
        if weights is not None and ctx.needs_input_grad[1]:
            # one dot product over D per slot, inside one row: no row is shared between slots
            acc = torch.promote_types(out.dtype, torch.float32)
            per_row = (grad.index_select(0, order // k).to(acc) * out.to(acc)).sum(-1)  # [N*k] in sorted order
            grad_w = per_row.index_select(0, rows).view_as(weights).to(weights.dtype)
        return grad_out, grad_w, None, None, None, None


def permute(x: torch.Tensor, routing: Routing, *, backend: Backend = "auto") -> torch.Tensor:
    """x [N, D] -> [N * k, D] in expert-sorted order; the backward sums each token's k rows in choice order."""
    _check_rows(x, routing.order.numel() // routing.k, "x")
    return _Permute.apply(x, routing.order, routing.rows, routing.k, backend)


def combine(out: torch.Tensor, routing: Routing, weights: torch.Tensor | None = None, *,
            backend: Backend = "auto") -> torch.Tensor:
    """out [N * k, D] in expert-sorted order -> [N, D]: each token's k rows times `weights` [N, k] (if given),
    summed in choice order. Differentiable in `out` and `weights`."""
    _check_rows(out, routing.order.numel(), "out")
    if weights is not None and weights.numel() != routing.order.numel():
        raise UsageError(f"weights has {weights.numel()} elements; the routing has {routing.order.numel()} slots")
    return _Combine.apply(out, weights, routing.order, routing.rows, routing.k, backend)


def _check_rows(t: torch.Tensor, rows: int, name: str) -> None:
    if t.dim() != 2 or t.shape[0] != rows:
        raise UsageError(f"{name} must be [{rows}, D] for this routing, not of shape {tuple(t.shape)}")
