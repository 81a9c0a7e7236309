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

Sequence parallelism, torchtitan's: `SequenceParallel` on the norms (activations sharded on the sequence, Shard(1)),
a column-wise layer taking a Shard(1) input (gathered: no arithmetic) and a row-wise one giving a Shard(1) output
(the whole fixed-tree sum, then this rank's block: torch's reduce-scatter adds in an order that depends on T), and
torch's own `PrepareModuleInput` / `PrepareModuleOutput` between them (a gather or a slice). A norm's parameter
gradients, sums over tokens that torch takes over each rank's tokens and all-reduces, are the fixed tree over
`chunks` fixed chunks of the sequence (see `SequenceParallel`).

What it cannot keep, refused in one sentence: torch's own styles in the plan (their all-reduce adds in an order that
depends on T), a Partial layout in torch's PrepareModuleInput / PrepareModuleOutput (an all-reduce), a sequence
dimension other than 1 or a sequence length the chunks do not divide, an input given as a DTensor placed otherwise
than the style's input layout, a row-wise linear layer whose input is replicated, and modules other than nn.Linear
and nn.Embedding (a norm's for SequenceParallel).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel as TorchSequenceParallel
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.func import functional_call

from detrace.errors import UsageError
from detrace.parallel.expert_parallel import ExpertParallel
from detrace.parallel.tensor import Combine, _Column, _Row, _split, _tree, group_combine, owned_chunks

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "parallelize_module"]

CHUNKS = 8
"""The default number of fixed chunks of a layer's sharded dimension: the largest T it allows."""


SEQUENCE = Shard(1)
"""The sequence-parallel layout of activations [batch, sequence, ...]: torchtitan's, the only one taken."""


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


def _local(x: Any, layout: Any) -> torch.Tensor:
    """The local tensor of a module's input, which must be in the style's input `layout` (taking another DTensor's
    local shard as this layout's would compute on the wrong rows)."""
    if isinstance(x, DTensor):
        if isinstance(layout, Shard) and layout.dim < 0:
            layout = Shard(layout.dim + x.ndim)  # DTensor keeps Shard(-1) as Shard(ndim - 1)
        if tuple(x.placements) != (layout,):
            raise UsageError(f"a detrace tensor-parallel style takes its input as {layout!r}, not as a DTensor "
                             f"placed {', '.join(map(repr, x.placements))}")
        return x.to_local()
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"a tensor-parallel style takes one tensor, not {type(x).__name__}")
    return x


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup, size: int, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


class _Gather(torch.autograd.Function):
    """The ranks' shards concatenated along `dim` (no arithmetic); backward: this rank's block of the gradient,
    which is whole and the same on every rank."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int,
                dim: int) -> torch.Tensor:
        ctx.rank, ctx.width, ctx.dim = rank, y.shape[dim], dim
        return _all_gather(y, group, size, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None, None


class _Slice(torch.autograd.Function):
    """This rank's block along `dim` of a tensor that is whole and the same on every rank (torch's reduce-scatter
    once the sum is complete: no arithmetic); backward: the ranks' blocks of the gradient gathered."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int,
                dim: int) -> torch.Tensor:
        if y.shape[dim] % size:
            raise UsageError(f"a sequence-parallel output's dimension {dim} ({y.shape[dim]}) must split evenly "
                             f"over {size} tensor-parallel ranks")
        ctx.group, ctx.size, ctx.dim = group, size, dim
        width = y.shape[dim] // size
        return y.narrow(dim, rank * width, width).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather(grad, ctx.group, ctx.size, ctx.dim), None, None, None, None


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

    def _group(self, mesh: Any) -> tuple[dist.ProcessGroup, int, int]:
        """The tensor-parallel group of a 1-D `mesh`, this rank in it and its size (T), checked against the chunks."""
        if mesh.ndim != 1:
            raise UsageError(f"parallelize_module takes a 1-D tensor-parallel mesh, not a {mesh.ndim}-D one")
        group = mesh.get_group()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        owned_chunks(self.chunks, size, rank)  # refuses a T that is not a power of two dividing the chunks
        return group, rank, size

    def _shard_linear(self, module: nn.Linear, mesh: Any) -> tuple[int, dist.ProcessGroup, int, int]:
        group, rank, size = self._group(mesh)
        length = module.weight.shape[self.dim]
        if length % self.chunks:
            raise UsageError(f"{type(self).__name__}(chunks={self.chunks}) must divide the layer's "
                             f"{'output' if self.dim == 0 else 'input'} features ({length})")
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
    """torch's ColwiseParallel (same arguments; input Replicate or sequence-parallel Shard(1), output Shard(-1) or
    Replicate), computed in `chunks` fixed chunks of output features, whose input gradient is the fixed tree over
    them (with a Shard(1) input: gathered first, the whole input gradient sliced after, no other arithmetic)."""

    dim = 0

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True,
                 chunks: int = CHUNKS) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._take_chunks(chunks)
        if not (isinstance(self.input_layouts[0], Replicate) or self.input_layouts[0] == SEQUENCE):
            raise UsageError("detrace's ColwiseParallel takes a Replicate or a Shard(1) (sequence-parallel) input, "
                             f"not {self.input_layouts[0]}")
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
        layout = self.input_layouts[0]

        def forward(x: Any) -> Any:
            weight = module.weight.to_local()  # type: ignore[attr-defined]
            # each chunk in an allocation of its own: the same layout at every T (see tensor._split)
            parts = [w.clone() for w in weight.split(chunk, dim=0)]
            x = _local(x, layout)
            if layout == SEQUENCE and size > 1:  # the whole sequence, as at T = 1
                x = _Gather.apply(x, group, rank, size, 1)
            y = _Column.apply(x, combine, False, *parts)
            if module.bias is not None:
                y = _Bias.apply(y, module.bias.to_local(), chunk)  # type: ignore[attr-defined]
            if gather and size > 1:
                y = _Gather.apply(y, group, rank, size, -1)
            return self._output(y, device_mesh, Replicate() if gather else Shard(-1))

        # the instance's forward shadows nn.Linear's, for this module only
        object.__setattr__(module, "forward", forward)
        return module


class RowwiseParallel(TorchRowwise, _Style):
    """torch's RowwiseParallel (same arguments; input Shard(-1), output Replicate or sequence-parallel Shard(1)),
    computed in `chunks` fixed chunks of input features whose partial products are summed in the fixed tree over
    them; a Shard(1) output is this rank's block of the whole sum (torch's reduce-scatter as the same tree as its
    all-reduce, then the slice)."""

    dim = 1

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True,
                 chunks: int = CHUNKS) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._take_chunks(chunks)
        if not (isinstance(self.output_layouts[0], Replicate) or self.output_layouts[0] == SEQUENCE):
            raise UsageError("detrace's RowwiseParallel gives a Replicate or a Shard(1) (sequence-parallel) output, "
                             f"not {self.output_layouts[0]}")

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear):
            raise UsageError(f"RowwiseParallel takes nn.Linear or nn.Embedding, not {type(module).__name__}")
        if not _is_last_dim_shard(self.input_layouts[0]):
            raise UsageError("detrace's RowwiseParallel takes a linear layer's input sharded on its last "
                             "dimension (the output of a ColwiseParallel layer), not a replicated one")
        chunk, group, rank, size = self._shard_linear(module, device_mesh)
        combine = group_combine(group, "invariant")
        layout = self.output_layouts[0]

        def forward(x: Any) -> Any:
            weight = module.weight.to_local()  # type: ignore[attr-defined]
            parts = [w.clone() for w in weight.split(chunk, dim=1)]
            y = _Row.apply(_local(x, Shard(-1)), combine, False, *parts)
            if module.bias is not None:
                y = y + module.bias.to_local()  # type: ignore[attr-defined]  # whole on every rank: as at T = 1
            if layout == SEQUENCE:
                y = _Slice.apply(y, group, rank, size, 1)
            return self._output(y, device_mesh, layout)

        object.__setattr__(module, "forward", forward)
        return module


class _Copies(torch.autograd.Function):
    """`count` copies of each of a module's parameters (one per sequence chunk, so that each chunk's gradient is a
    leaf of its own: autograd would add them as they come); backward: each parameter's chunk gradients summed in
    the fixed tree over the chunks, completed across the ranks by `combine`."""

    @staticmethod
    def forward(ctx: Any, combine: Combine, count: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.combine, ctx.params = combine, len(params)
        return tuple(p.clone() for _ in range(count) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # (a copy no chunk used comes as zeros: autograd materializes a Function's missing gradients)
        # the leaves copied: the tree adds into its left operands, which autograd may still hold
        sums = [ctx.combine(_tree([g.clone() for g in grads[k::ctx.params]])) for k in range(ctx.params)]
        return (None, None, *sums)


class _Join(torch.autograd.Function):
    """The chunks' outputs concatenated along `dim` (no arithmetic); backward: each chunk's gradient in an
    allocation of its own, as its input was (see tensor._split)."""

    @staticmethod
    def forward(ctx: Any, dim: int, *outs: torch.Tensor) -> torch.Tensor:
        ctx.dim, ctx.width = dim, outs[0].shape[dim]
        return torch.cat(outs, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *_split(grad, ctx.width, ctx.dim))


class SequenceParallel(TorchSequenceParallel, _Style):
    """torch's SequenceParallel (same arguments; a norm's input and output sharded on `sequence_dim`, its
    parameters replicated), whose parameters' gradients do not depend on T: the whole sequence is cut into
    `chunks` fixed chunks (8 by default: the sequence length a multiple of it, T dividing it), rank t runs the
    module's own forward on each of its chunks alone, in an allocation of its own, with a copy of the parameters,
    and each parameter's chunk gradients are summed in the fixed tree over the chunks, its top levels completed
    across ranks as the linear styles' sums, where torch sums each rank's tokens and all-reduces the ranks'
    partial sums. Per-token arithmetic (a norm's output and input gradient) is the same on a chunk as on the
    whole sequence."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False, chunks: int = CHUNKS) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)
        self._take_chunks(chunks)
        if sequence_dim != SEQUENCE.dim:
            raise UsageError(f"detrace's SequenceParallel shards the sequence on dimension 1 (torchtitan's), not "
                             f"{sequence_dim}")

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if any(True for child in module.children() for _ in child.parameters()):
            raise UsageError(f"SequenceParallel takes a module whose parameters are its own (a norm), not "
                             f"{type(module).__name__} with submodules' parameters")
        group, _, size = self._group(device_mesh)
        count = self.chunks // size  # this rank's chunks of the sequence
        combine = group_combine(group, "invariant")
        source = getattr(self, "src_data_rank", 0)
        params = dict(module.named_parameters(recurse=False))
        for name, param in params.items():
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [Replicate()], src_data_rank=source),
                requires_grad=param.requires_grad))
        plain_forward = module.forward  # the class's, bound: run on each chunk with its copies
        inside = [False]

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if inside[0]:  # functional_call's call of the module, one chunk
                return plain_forward(x, *args, **kwargs)
            x = _local(x, SEQUENCE)
            if x.shape[1] % count:
                raise UsageError(f"SequenceParallel(chunks={self.chunks}) must divide the sequence length "
                                 f"({x.shape[1] * size})")
            width = x.shape[1] // count
            copies = _Copies.apply(combine, count, *(module.get_parameter(n).to_local()  # type: ignore[attr-defined]
                                                     for n in params))
            outs = []
            inside[0] = True
            try:
                for j, part in enumerate(_split(x, width, 1)):
                    views = dict(zip(params, copies[j * len(params):(j + 1) * len(params)], strict=True))
                    outs.append(functional_call(module, views, (part, *args), kwargs))
            finally:
                inside[0] = False
            y = _Join.apply(1, *outs)
            return y if self.use_local_output else DTensor.from_local(y, device_mesh, [SEQUENCE], run_check=False)

        # the instance's forward shadows the class's, for this module only (as the linear styles')
        object.__setattr__(module, "forward", forward)
        return module


def _keeps_bits(style: Any) -> bool:
    """Whether `style` is one of detrace's, or torch's PrepareModuleInput / PrepareModuleOutput moving no Partial
    (a redistribution between Shard and Replicate is a gather or a slice: no arithmetic)."""
    if isinstance(style, ColwiseParallel | RowwiseParallel | SequenceParallel | ExpertParallel):
        return True
    if not isinstance(style, PrepareModuleInput | PrepareModuleOutput):
        return False
    layouts = [getattr(style, name, None) for name in ("input_layouts", "desired_input_layouts",
                                                       "input_kwarg_layouts", "desired_input_kwarg_layouts",
                                                       "output_layouts", "desired_output_layouts")]
    flat = [p for value in layouts if value for p in (value.values() if isinstance(value, dict) else value)]
    return not any(isinstance(p, Partial) for p in flat)


def parallelize_module(module: nn.Module, device_mesh: Any = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """torch.distributed.tensor.parallel.parallelize_module with detrace's styles (same arguments; the plan's
    keys may hold torch's wildcards). Refuses any other style in one sentence."""
    styles = parallelize_plan.values() if isinstance(parallelize_plan, dict) else [parallelize_plan]
    for style in styles:
        if style is not None and not _keeps_bits(style):
            raise UsageError(f"detrace.parallel.parallelize_module takes detrace's ColwiseParallel, "
                             f"RowwiseParallel, SequenceParallel and ExpertParallel (and torch's PrepareModuleInput "
                             f"and PrepareModuleOutput without Partial layouts), not {type(style).__module__}."
                             f"{type(style).__name__} (its reductions add in an order that depends on the mesh)")
    return torch_parallelize_module(module, device_mesh, parallelize_plan, src_data_rank=src_data_rank)
