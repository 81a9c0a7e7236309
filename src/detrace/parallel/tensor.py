"""Tensor parallelism whose bits do not depend on the tensor-parallel size T.

A linear layer y = x W^T (W of shape [out, in]) is split into fixed-size chunks, fixed by the model (never by
the device or by T): `ColumnParallelLinear` chunks W's rows (the output features), `RowParallelLinear` its
columns (the inner dimension). Each chunk is a parameter of its own, named by its global index
(`<layer>.chunks.<j>`), so a layer's parameters have the same names and shapes at every T; rank t of T holds
the contiguous block of chunks [t n/T, (t + 1) n/T) of a layer's n chunks (T a power of two dividing n).

Every matrix product is one chunk's, with the same shapes at every T; every sum over chunks is one fixed
balanced binary tree over the chunk indices (the tree of `detrace.parallel.data`), whose top log2 T levels are
completed across ranks by the same fixed-order exchange as invariant data parallelism:

| layer  | forward                         | input gradient                  | weight gradient (chunk j)  |
|--------|---------------------------------|---------------------------------|----------------------------|
| column | y_j = x W_j^T, concatenated     | tree over j of g_j W_j          | g_j^T x                    |
| row    | tree over j of x_j W_j^T        | g W_j, concatenated             | g^T x_j                    |

The column layer's input and the row layer's output gradient are the same on every rank (replicated), so
every operand is the same at every T and the tree gives the same bits as T = 1: forward and backward.

`mode="plain"` is ordinary tensor parallelism on the same chunked parameters, the negative control: one matrix
product over the rank's whole block and an all-reduce of the partial sums, whose order depends on T.

    attn_q = ColumnParallelLinear(wq.weight, chunk=16, group=tp_group)   # keeps this rank's chunks
    attn_o = RowParallelLinear(wo.weight, chunk=16, group=tp_group)
    y = attn_o(attention(attn_q(x)))                                      # y: the same bits at every T
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from detrace.errors import UsageError
from detrace.parallel.data import _all_gather, _exchange, _tree_sum, _world

__all__ = ["MODES", "TP_ENV", "ColumnParallelLinear", "Combine", "RowParallelLinear", "by_global_name",
           "global_parameter_names", "group_combine", "owned_chunks"]

TP_ENV = "DETRACE_TP"
"""`detrace check-topology --layouts DxT` runs CMD on D*T processes with this variable set to T: the tensor-parallel
size CMD is to use."""

MODES = ("invariant", "plain")
"""invariant: fixed chunks and one fixed tree; plain: one product per rank and an all-reduce (the control)."""

Combine = Callable[[torch.Tensor], torch.Tensor]
"""Completes a sum across the tensor-parallel ranks: takes this rank's partial sum, returns the whole sum (the
same on every rank). A parameter so that tests can simulate T ranks in one process."""


def owned_chunks(chunks: int, size: int, rank: int) -> range:
    """The global chunk indices rank `rank` of `size` holds: a contiguous block of chunks / size."""
    if size < 1 or size & (size - 1):
        raise UsageError(f"invariant tensor parallelism needs a power-of-two size, not {size}")
    if chunks % size:  # a rank's block must be a node of the tree over the chunks
        raise UsageError(f"{chunks} chunks do not split evenly over {size} tensor-parallel ranks")
    if not 0 <= rank < size:
        raise UsageError(f"rank {rank} is not one of {size} tensor-parallel ranks")
    per = chunks // size
    return range(rank * per, (rank + 1) * per)


def group_combine(group: dist.ProcessGroup | None, mode: str) -> Combine:
    """The real exchange over `group`: the fixed tree's top levels (invariant) or an all-reduce (plain)."""
    rank, size = _world(group)
    if size == 1:
        return lambda t: t
    if mode == "plain":
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=group)  # the library's reduction order, which depends on T
            return t
        return all_reduce
    return lambda t: _exchange([t.reshape(-1)], group=group, rank=rank, world=size, how="auto")[0].view(t.shape)


def _tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """The fixed tree's sum of `parts` (a block of consecutive chunks' partial products, in chunk order)."""
    return _tree_sum([[p] for p in parts])[0]


def _split(t: torch.Tensor, chunk: int, dim: int = -1) -> list[torch.Tensor]:
    """`t`'s dimension `dim` (the last by default) in chunks, each copied into an allocation of its own: a chunk's
    operand then has the same layout and alignment at every T (a view at an offset would not: a CPU dot product's
    bits may depend on its operand's alignment, and `contiguous()` keeps a view that happens to be contiguous)."""
    return [p.clone(memory_format=torch.contiguous_format) for p in t.split(chunk, dim=dim)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Column(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, combine: Combine, plain: bool, *chunks: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *chunks)
        ctx.combine, ctx.plain = combine, plain
        if plain:
            return F.linear(x, torch.cat(chunks))
        return torch.cat([F.linear(x, w) for w in chunks], dim=-1)  # y_j = x W_j^T, each alone

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *chunks = ctx.saved_tensors
        chunk = chunks[0].shape[0]
        if ctx.plain:
            weight = torch.cat(chunks)
            grad_x = ctx.combine(grad @ weight)
            grad_w = list((_rows(grad).T @ _rows(x)).split(chunk))
        else:
            parts = _split(grad, chunk)
            grad_x = ctx.combine(_tree([g @ w for g, w in zip(parts, chunks, strict=True)]))
            grad_w = [_rows(g).T @ _rows(x) for g in parts]  # the sum over tokens: the same at every T
        return (grad_x, None, None, *grad_w)


class _Row(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, combine: Combine, plain: bool, *chunks: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *chunks)
        ctx.plain = plain
        if plain:
            return combine(F.linear(x, torch.cat(chunks, dim=1)))
        chunk = chunks[0].shape[1]
        return combine(_tree([F.linear(xj, w) for xj, w in zip(_split(x, chunk), chunks, strict=True)]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *chunks = ctx.saved_tensors
        chunk = chunks[0].shape[1]
        if ctx.plain:
            weight = torch.cat(chunks, dim=1)
            grad_x = grad @ weight
            grad_w = list((_rows(grad).T @ _rows(x)).split(chunk, dim=1))
        else:
            grad_x = torch.cat([grad @ w for w in chunks], dim=-1)  # the sum over `out`: whole on every rank
            grad_w = [_rows(grad).T @ _rows(xj) for xj in _split(x, chunk)]
        return (grad_x, None, None, *grad_w)


class _ChunkedLinear(nn.Module):
    """This rank's chunks of a linear layer's weight, as parameters named by global chunk index."""

    dim: int
    """The weight dimension that is chunked: 0 (output features, column) or 1 (inner dimension, row)."""

    def __init__(self, weight: torch.Tensor, *, chunk: int, group: dist.ProcessGroup | None = None,
                 mode: str = "invariant", combine: Combine | None = None, rank: int | None = None,
                 size: int | None = None) -> None:
        super().__init__()
        if mode not in MODES:
            raise UsageError(f"tensor-parallel mode {mode!r} must be one of {', '.join(MODES)}")
        if weight.dim() != 2:
            raise UsageError(f"a linear layer's weight has 2 dimensions, not {weight.dim()}")
        length = weight.shape[self.dim]
        if chunk < 1 or length % chunk:
            raise UsageError(f"chunk size {chunk} must divide the weight's dimension {self.dim} ({length})")
        if combine is None:
            rank, size = _world(group)
            combine = group_combine(group, mode)
        elif rank is None or size is None:
            raise UsageError("a simulated combine needs the rank and the size it stands for")
        self.chunk, self.mode, self.combine = chunk, mode, combine
        self.total = length // chunk
        """The layer's chunks on all ranks together."""
        self.owned = owned_chunks(self.total, size, rank)
        """The global indices of the chunks this rank holds."""
        pieces = weight.detach().split(chunk, dim=self.dim)
        self.chunks = nn.ParameterDict({str(j): nn.Parameter(pieces[j].clone()) for j in self.owned})

    def _weights(self) -> Sequence[torch.Tensor]:
        return [self.chunks[str(j)] for j in self.owned]


class ColumnParallelLinear(_ChunkedLinear):
    """y[..., block] = x W[block]^T: this rank's output features, each chunk computed as at T = 1.

    No bias: it takes the weight alone (a module's bias is not read). Keep the layer bias-free (as Llama's
    projections), or add a bias after the row-parallel layer that follows, where the output is whole on every rank.

    Args:
        weight: the whole [out, in] weight, the same on every rank (this rank keeps its chunks of rows).
        chunk: output features per chunk, fixed by the model; out / chunk must divide by T.
        group: the tensor-parallel group (default: the world; none without torch.distributed).
        mode: "invariant" or "plain" (the control, see the module doc).
        combine, rank, size: simulate rank `rank` of `size` in one process (tests); default: `group`.
    """

    dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Column.apply(x, self.combine, self.mode == "plain", *self._weights())
        assert isinstance(out, torch.Tensor)
        return out


class RowParallelLinear(_ChunkedLinear):
    """y = sum over chunks j of x_j W_j^T, x holding this rank's inner features: the whole y on every rank.

    No bias: add one after it as a plain parameter, `layer(x) + bias`: y is whole on every rank, so the bias is a
    replica like any unsharded parameter (the same bits at every T). Adding it inside the sum would add it once
    per rank.

    Args as `ColumnParallelLinear`; `chunk` counts inner features (in / chunk must divide by T).
    """

    dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Row.apply(x, self.combine, self.mode == "plain", *self._weights())
        assert isinstance(out, torch.Tensor)
        return out


def global_parameter_names(model: nn.Module) -> tuple[list[str], set[str]]:
    """The names of the whole model's parameters, as at T = 1, sorted (the same list on every rank at every T),
    and which of them are chunks (held by one rank of the tensor-parallel group; the others are replicas)."""
    chunked = {f"{prefix}.chunks.{j}" if prefix else f"chunks.{j}"
               for prefix, m in model.named_modules() if isinstance(m, _ChunkedLinear) for j in range(m.total)}
    own = {name for name, _ in model.named_parameters()}
    return sorted(chunked | own), chunked


def by_global_name(model: nn.Module, values: dict[str, torch.Tensor], *, dtype: torch.dtype,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A vector of one scalar per parameter of the whole model (`values`: this rank's, by name), in the order of
    `global_parameter_names`: the same bits on every rank and at every T. Each entry comes from one rank (a
    chunk's holder; rank 0 of `group` for a replica), the others add zero, which changes no bit. Collective
    over the tensor-parallel `group`."""
    names, chunked = global_parameter_names(model)
    index = {name: i for i, name in enumerate(names)}
    rank = _world(group)[0]
    device = next(iter(values.values())).device if values else None
    vector = torch.zeros(len(names), dtype=dtype, device=device)
    for name, value in values.items():
        if name in chunked or rank == 0:
            vector[index[name]] = value
    return sum_of_parts(vector, group)


def sum_of_parts(vector: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `vector` of `group` added in rank order, where each entry is nonzero on one rank at most (the
    others add zero, which changes no bit): the whole vector, the same bits on every rank. Collective."""
    size = _world(group)[1]
    if size == 1:
        return vector
    every = torch.empty(size * vector.numel(), dtype=vector.dtype, device=vector.device)
    _all_gather(every, vector, group)
    rows = every.view(size, -1)
    total = rows[0].clone()
    for row in rows[1:]:
        total += row  # one nonzero per entry: x + 0 is x
    return total
