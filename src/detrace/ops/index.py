"""Deterministic index accumulation: `index_add`, `index_put(accumulate=True)`, `scatter_add`.

All three reduce to one operation on rows: dest[index[i]] += src[i] for i = 0, 1, ..., R - 1. It is computed
by sorting the index once (stably), then a segmented reduction in a fixed order: each destination row starts
from its old value and adds its sources in increasing i, in float32 (one rounding at the end for
lower-precision rows). That is the order of torch's serial CPU loop, so for float32 the bits equal torch's
deterministic mode on CPU.

- PyTorch path: the segments are sorted by length, so pass j (the j-th source of every segment with more than
  j) is one vectorised add into a prefix of the accumulator; the passes run in j order.
- Triton path (CUDA): one program per (destination row, column block) walks its sources in order; no atomics.

`detrace.ops.routing` registers these as the kernels of the aten ops (torch.library) on the devices where they
beat torch's own deterministic implementation.
"""

from __future__ import annotations

import torch

from detrace.errors import UsageError
from detrace.ops.moe import Backend, _use_triton


def accumulate_rows_(dest: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *, alpha: float = 1.0,
                     backend: Backend = "auto") -> torch.Tensor:
    """dest [M, C] (contiguous) += src [R, C] scattered by index [R] (0 <= index < M), in increasing source order."""
    if index.numel() == 0:
        return dest
    order = index.argsort(stable=True)
    sorted_index = index.index_select(0, order)
    targets, counts = torch.unique_consecutive(sorted_index, return_counts=True)
    if _use_triton(dest, backend) and dest.is_floating_point():
        from detrace.ops import _triton

        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=dest.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        _triton.segment_sum_(dest, targets, offsets, order, src, alpha)
        return dest
    # floats add in float32 (or wider); integers add exactly in their own type
    acc_dtype = torch.promote_types(dest.dtype, torch.float32) if dest.is_floating_point() else dest.dtype
    # Longest segments first, so that the segments still adding at pass j are a prefix of the accumulator.
    by_length = counts.argsort(descending=True, stable=True)
    position = torch.empty_like(by_length).scatter_(0, by_length, torch.arange(by_length.numel(), device=dest.device))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(index.numel(), device=dest.device) - starts.repeat_interleave(counts)
    # (pass, segment position) is unique per source: ordering by it lays the passes out one after another
    key = rank * by_length.numel() + position.repeat_interleave(counts)
    sources = order.index_select(0, key.argsort())
    values = src.index_select(0, sources).to(acc_dtype)
    if alpha != 1.0:
        values *= alpha
    rows = targets.index_select(0, by_length)
    acc = dest.index_select(0, rows).to(acc_dtype)
    sizes = torch.bincount(rank).tolist()  # sizes[j]: segments longer than j (non-increasing)
    start = 0
    for size in sizes:
        acc[:size] += values[start : start + size]
        start += size
    # every row is written once: rows are distinct
    dest.index_copy_(0, rows, acc.to(dest.dtype))
    return dest


def _check_index(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    if index.dtype not in (torch.int64, torch.int32):
        raise UsageError(f"{what}: the index must be int64 or int32, not {index.dtype}")
    index = index.to(torch.int64)
    if index.numel() and (int(index.min()) < -size or int(index.max()) >= size):
        raise IndexError(f"{what}: index out of range for a dimension of size {size}")
    return torch.where(index < 0, index + size, index)


def _rows_view(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, bool]:
    """`t` with `dim` first, as a contiguous [size, rest] tensor; and whether it is a view of `t`."""
    moved = t.movedim(dim, 0)
    if moved.is_contiguous():
        return moved.view(moved.shape[0], -1), True
    return moved.contiguous().view(moved.shape[0], -1), False


def index_add_(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha: float = 1.0,
               backend: Backend = "auto") -> torch.Tensor:
    """Deterministic `self.index_add_(dim, index, source, alpha=alpha)`."""
    dim = dim % max(self.dim(), 1)
    if self.dim() == 0:
        self.add_(source.reshape(()) * alpha) if index.numel() else None
        return self
    idx = _check_index(index.reshape(-1), self.shape[dim], "index_add")
    rows, is_view = _rows_view(self, dim)
    src = source.movedim(dim, 0).reshape(idx.numel(), -1) if source.dim() else source.reshape(1, 1)
    accumulate_rows_(rows, idx, src.to(self.dtype), alpha=alpha, backend=backend)
    if not is_view:
        self.copy_(rows.view(self.movedim(dim, 0).shape).movedim(0, dim))
    return self


def index_add(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha: float = 1.0,
              backend: Backend = "auto") -> torch.Tensor:
    """Deterministic `torch.index_add` (out of place)."""
    return index_add_(self.clone(memory_format=torch.contiguous_format), dim, index, source, alpha=alpha,
                      backend=backend)


def _element_positions(shape: tuple[int, ...], indices: list[torch.Tensor | None],
                       device: torch.device) -> torch.Tensor:
    """Row-major flat position in a tensor of `shape` of every element `t[indices]` selects: advanced
    indexing applied to per-dimension coordinate grids (expanded, so nothing of `shape`'s size is made)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    total: torch.Tensor | None = None
    for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        grid = (torch.arange(size, device=device) * stride).view([size if e == d else 1 for e in range(len(shape))])
        part = grid.expand(shape)[tuple(slice(None) if i is None else i for i in indices)]
        total = part if total is None else total + part
    assert total is not None
    return total


def index_put_(self: torch.Tensor, indices: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...],
               values: torch.Tensor, accumulate: bool = False, *, backend: Backend = "auto") -> torch.Tensor:
    """Deterministic `self.index_put_(indices, values, accumulate)`. With accumulate, repeated positions add in
    index order; without, the last of repeated positions' values (in index order) lands."""
    indices = list(indices)
    first = indices[0] if indices else None
    single = (len(indices) == 1 and first is not None and first.dtype in (torch.int64, torch.int32)
              and self.dim() >= 1)
    if single and accumulate:
        assert first is not None
        idx = _check_index(first.reshape(-1), self.shape[0], "index_put")
        rows, is_view = _rows_view(self, 0)
        src = values.expand(*first.shape, *self.shape[1:]).reshape(idx.numel(), -1)
        accumulate_rows_(rows, idx, src.to(self.dtype), backend=backend)
        if not is_view:
            self.copy_(rows.view(self.shape))
        return self
    if self.dim() == 0:
        # no dimension to index: torch allows only boolean masks here
        mask = indices[0] if indices else None
        if mask is None or bool(mask.all()):
            self.copy_(self + values.reshape(()) if accumulate else values.reshape(()))
        return self
    positions = _element_positions(tuple(self.shape), indices, self.device)
    flat_values = values.to(self.dtype).expand(positions.shape).reshape(-1)
    flat = self.view(-1) if self.is_contiguous() else self.contiguous().view(-1)
    if accumulate:
        accumulate_rows_(flat.unsqueeze(1), positions.reshape(-1), flat_values.unsqueeze(1), backend=backend)
    else:
        _put_last_(flat, positions.reshape(-1), flat_values)
    if not self.is_contiguous():
        self.copy_(flat.view(self.shape))
    return self


def _put_last_(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """flat[positions[i]] = values[i]; of repeated positions the last i wins. Deduplicated first, so that the
    copy has one writer per position (torch's `put_` lets repeated writers race)."""
    order = positions.argsort(stable=True)
    ordered = positions.index_select(0, order)
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    keep = order[last]
    flat.index_copy_(0, positions.index_select(0, keep), values.index_select(0, keep))


def scatter_add_(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, *,
                 backend: Backend = "auto") -> torch.Tensor:
    """Deterministic `self.scatter_add_(dim, index, src)`."""
    if index.numel() == 0:
        return self
    if self.dim() == 0:
        return self.add_(src.reshape(-1)[0])
    dim = dim % self.dim()
    idx = _check_index(index, self.shape[dim], "scatter_add")
    # the coordinates of each element of `index`, with its own coordinate along `dim` replaced by the index
    coords: list[torch.Tensor | None] = []
    for d in range(self.dim()):
        if d == dim:
            coords.append(idx)
        else:
            view = [index.shape[d] if e == d else 1 for e in range(self.dim())]
            coords.append(torch.arange(index.shape[d], device=self.device).view(view).expand(index.shape))
    positions = _element_positions(tuple(self.shape), coords, self.device)
    values = src[tuple(slice(0, n) for n in index.shape)].to(self.dtype).reshape(-1, 1)
    flat = self.view(-1) if self.is_contiguous() else self.contiguous().view(-1)
    accumulate_rows_(flat.unsqueeze(1), positions.reshape(-1), values, backend=backend)
    if not self.is_contiguous():
        self.copy_(flat.view(self.shape))
    return self


def scatter_add(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, *,
                backend: Backend = "auto") -> torch.Tensor:
    """Deterministic `torch.scatter_add` (out of place)."""
    return scatter_add_(self.clone(memory_format=torch.contiguous_format), dim, index, src, backend=backend)
