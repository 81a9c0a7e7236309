"""`parallelize_module`, `ColwiseParallel` and `RowwiseParallel` as drop-ins: torch's tensor-parallel plan, whose
bits do not depend on the tensor-parallel size T.

    from detrace.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, tp_mesh, {"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                                        "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()})

As with torch's styles, a parallelized `nn.Linear` keeps its parameter names and global shapes: its weight becomes a
DTensor sharded over the mesh (rows for column-wise, columns for row-wise), so the model's state dict is the same
at every T and one checkpoint (`torch.distributed.checkpoint`) fits every mesh. What changes is the arithmetic: the
weight's sharded dimension is cut into `chunks` fixed chunks (8 by default: any T dividing it), each chunk's product
is computed alone with the same shapes at every T, and every sum over chunks (a row-wise output, a column-wise
input gradient) is the fixed balanced tree over the chunk indices, completed across ranks by the fixed-order
exchange of `detrace.parallel.tensor` instead of torch's all-reduce. So a layer's output and gradients are the same
bits at T = 1, 2, 4, 8; at T = 1 they are the chunked product, not nn.Linear's one product (parallelize the model at
every T, one included).

An `nn.Embedding` is given to torch's own style: its row-wise lookup adds only zeros to one rank's rows, and its
column-wise one concatenates, so torch's reduction changes no bit there.

What it cannot keep, refused in one sentence: torch's own styles in the plan (their all-reduce adds in an order that
depends on T), sequence-parallel layouts (`SequenceParallel`, `Shard(1)` inputs or outputs: the norms' weight
gradients would be summed over the ranks' tokens), a row-wise linear layer whose input is replicated, and modules
other than nn.Linear and nn.Embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from detrace.errors import UsageError
from detrace.parallel.expert_parallel import ExpertParallel
from detrace.parallel.tensor import _Column, _Row, _split, group_combine, owned_chunks

__all__ = ["ColwiseParallel", "RowwiseParallel", "parallelize_module"]

CHUNKS = 8
"""The default number of fixed chunks of a layer's sharded dimension: the largest T it allows."""


def _is_last_dim_shard(placement: Any) -> bool:
    return isinstance(placement, Shard) and placement.dim == -1


class _Bias(torch.autograd.Function):
    """y + b for a column-wise layer's bias shard, whose gradient (the sum over tokens) is taken chunk by chunk in
    allocations of their own: the same operands, so the same bits, at every T."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, bias: torch.Tensor, chunk: int) -> torch.Tensor:
        ctx.chunk = chunk
        return y + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        parts = [g.reshape(-1, g.shape[-1]).sum(0) for g in _split(grad, ctx.chunk)]
        return grad, torch.cat(parts), None


def _local(x: Any) -> torch.Tensor:
    if isinstance(x, DTensor):
        return x.to_local()
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"a tensor-parallel linear layer takes one tensor, not {type(x).__name__}")
    return x


class _Gather(torch.autograd.Function):
    """The column-wise output's shards concatenated along the last dimension (no arithmetic); backward: this
    rank's block of the gradient, which is whole and the same on every rank."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, y.shape[-1]
        pieces = [torch.empty_like(y) for _ in range(size)]
        dist.all_gather(pieces, y.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = ctx.rank * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None, None, None


class _Style:
    """What the two linear styles share: the checks, the weight as a sharded DTensor parameter, and the forward."""

    dim: int
    """The weight dimension that is sharded and chunked: 0 (column-wise) or 1 (row-wise)."""
    chunks: int
    use_local_output: bool

    def _take_chunks(self, chunks: int) -> None:
        if chunks < 1:
            raise UsageError(f"chunks must be positive, not {chunks}")
        self.chunks = chunks

    def _shard_linear(self, module: nn.Linear, mesh: Any) -> tuple[int, dist.ProcessGroup, int, int]:
        if mesh.ndim != 1:
            raise UsageError(f"parallelize_module takes a 1-D tensor-parallel mesh, not a {mesh.ndim}-D one")
        group = mesh.get_group()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        length = module.weight.shape[self.dim]
        if length % self.chunks:
            raise UsageError(f"{type(self).__name__}(chunks={self.chunks}) must divide the layer's "
                             f"{'output' if self.dim == 0 else 'input'} features ({length})")
        owned_chunks(self.chunks, size, rank)  # refuses a T that is not a power of two dividing the chunks
        source = getattr(self, "src_data_rank", 0)
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(self.dim)],
                                                       src_data_rank=source))
        if module.bias is not None:
            placement = Shard(0) if self.dim == 0 else Replicate()
            module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [placement],
                                                         src_data_rank=source))
        return length // self.chunks, group, rank, size

    def _output(self, y: torch.Tensor, mesh: Any, placement: Any) -> Any:
        return y if self.use_local_output else DTensor.from_local(y, mesh, [placement], run_check=False)


class ColwiseParallel(TorchColwise, _Style):
    """torch's ColwiseParallel (same arguments; input Replicate, output Shard(-1) or Replicate), computed in
    `chunks` fixed chunks of output features, whose input gradient is the fixed tree over them."""

    dim = 0

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True,
                 chunks: int = CHUNKS) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._take_chunks(chunks)
        if not isinstance(self.input_layouts[0], Replicate):
            raise UsageError("detrace's ColwiseParallel takes a replicated input (sequence parallelism is not "
                             "supported)")
        if not (_is_last_dim_shard(self.output_layouts[0]) or isinstance(self.output_layouts[0], Replicate)):
            raise UsageError("detrace's ColwiseParallel gives a Shard(-1) or a Replicate output, not "
                             f"{self.output_layouts[0]}")

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear):
            raise UsageError(f"ColwiseParallel takes nn.Linear or nn.Embedding, not {type(module).__name__}")
        chunk, group, rank, size = self._shard_linear(module, device_mesh)
        combine = group_combine(group, "invariant")
        gather = isinstance(self.output_layouts[0], Replicate)

        def forward(x: Any) -> Any:
            weight = module.weight.to_local()  # type: ignore[attr-defined]
            # each chunk in an allocation of its own: the same layout at every T (see tensor._split)
            parts = [w.clone() for w in weight.split(chunk, dim=0)]
            y = _Column.apply(_local(x), combine, False, *parts)
            if module.bias is not None:
                y = _Bias.apply(y, module.bias.to_local(), chunk)  # type: ignore[attr-defined]
            if gather and size > 1:
                y = _Gather.apply(y, group, rank, size)
            return self._output(y, device_mesh, Replicate() if gather else Shard(-1))

        # the instance's forward shadows nn.Linear's, for this module only
        object.__setattr__(module, "forward", forward)
        return module


class RowwiseParallel(TorchRowwise, _Style):
    """torch's RowwiseParallel (same arguments; input Shard(-1), output Replicate), computed in `chunks` fixed
    chunks of input features whose partial products are summed in the fixed tree over them."""

    dim = 1

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True,
                 chunks: int = CHUNKS) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._take_chunks(chunks)
        if not isinstance(self.output_layouts[0], Replicate):
            raise UsageError("detrace's RowwiseParallel gives a replicated output (sequence parallelism is not "
                             "supported)")

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear):
            raise UsageError(f"RowwiseParallel takes nn.Linear or nn.Embedding, not {type(module).__name__}")
        if not _is_last_dim_shard(self.input_layouts[0]):
            raise UsageError("detrace's RowwiseParallel takes a linear layer's input sharded on its last "
                             "dimension (the output of a ColwiseParallel layer), not a replicated one")
        chunk, group, _, _ = self._shard_linear(module, device_mesh)
        combine = group_combine(group, "invariant")

        def forward(x: Any) -> Any:
            weight = module.weight.to_local()  # type: ignore[attr-defined]
            parts = [w.clone() for w in weight.split(chunk, dim=1)]
            y = _Row.apply(_local(x), combine, False, *parts)
            if module.bias is not None:
                y = y + module.bias.to_local()  # type: ignore[attr-defined]  # whole on every rank: as at T = 1
            return self._output(y, device_mesh, Replicate())

        object.__setattr__(module, "forward", forward)
        return module


def parallelize_module(module: nn.Module, device_mesh: Any = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """torch.distributed.tensor.parallel.parallelize_module with detrace's styles (same arguments; the plan's
    keys may hold torch's wildcards). Refuses any other style in one sentence."""
    styles = parallelize_plan.values() if isinstance(parallelize_plan, dict) else [parallelize_plan]
    for style in styles:
        if style is not None and not isinstance(style, ColwiseParallel | RowwiseParallel | ExpertParallel):
            raise UsageError(f"detrace.parallel.parallelize_module takes detrace's ColwiseParallel, "
                             f"RowwiseParallel and ExpertParallel, not {type(style).__module__}."
                             f"{type(style).__name__} (its reductions add in an order that depends on the mesh)")
    return torch_parallelize_module(module, device_mesh, parallelize_plan, src_data_rank=src_data_rank)
