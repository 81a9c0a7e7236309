"""`fully_shard` as a drop-in: torch's signature and semantics, gradients whose bits do not depend on the number of
shards.

    from detrace.parallel import fully_shard              # instead of torch.distributed.fsdp's

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for step in range(steps):                             # torchtitan's gradient accumulation:
        for x, y in my_microbatches(step):                #   this rank's n = M / W microbatches of the global batch
            (loss_fn(model(x), y) / n).backward()         #   one backward each, the loss scaled by 1 / n
        optimizer.step()
        optimizer.zero_grad()

torch's `fully_shard` reduce-scatters each microbatch's gradient (an average over the W ranks, added in an order
that depends on W and on the collective's algorithm) and adds the microbatches' shards in the order they ran. Here
the module's reduce-scatter only moves data (an all-to-all gives rank r every rank's contribution to shard r) and
its all-reduce hook sums the contributions in one fixed tree: rank s's k-th microbatch of a step is global
microbatch s n + k, and the tree over the M = W n global microbatches is the balanced binary tree, built as they
arrive (a binary counter per source rank, whose nodes are the tree's when n is a power of two), then completed over
the W source ranks and divided by W as torch's average. With W and n powers of two, every addition has the same two
operands at every W: the loss scaled by 1 / n scales a microbatch's gradient by an exact power of two, and so does
the division by W, so the shard holds the bits of the same rows at every W, one process included (where torch
never calls the reduce-scatter: the hook takes its input, the gradient, as the one contribution).

HSDP, a 2-D mesh (replicate R, shard S) as torch takes it: the parameters sharded over dimension 1, replicated over
dimension 0. The data ranks are R x S: rank (r, s) runs the microbatches of data index r S + s, so replica r's
microbatches are the contiguous node [r S n, (r + 1) S n) of the tree, which its shard's contributions give; the
replicas complete the tree above their nodes with `detrace.parallel.data`'s fixed-order exchange (at each
power-of-two count of microbatches, where the shard holds the tree's sum so far: log2(n) + 1 times a step), and the
shard is divided by R S as torch's average. torch's own all-reduce over the replicas still runs before the hook:
its result is replaced (an all-reduce's worth of communication per microbatch that the tree does not use).

A step is the backwards between two optimizer steps (a global optimizer hook closes it: it refuses a step whose
modules did not each receive the same power-of-two number of microbatches, then starts the next tree).
`set_requires_gradient_sync(False)` and `set_requires_all_reduce(False)` (torch's gradient accumulation without
communication) are accepted and change nothing: every microbatch's gradient is still reduced, since the tree takes
each one alone (accumulated before the reduction, they would be added in running order).

What it cannot keep, refused in one sentence: a mesh of more than two dimensions, `dp_mesh_dims`, a list of
modules, per-parameter meshes, and a custom reduce-scatter or all-reduce hook of the user's (they are this module's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace.errors import UsageError
from detrace.parallel.data import _exchange, _tree_sum
from detrace.parallel.fsdp import _AllToAllReduceScatter

__all__ = ["fully_shard"]


class _TreeReduceScatter(_AllToAllReduceScatter):
    """One FSDP module's reduce-scatter and all-reduce hook: the contributions to this rank's shard kept per source
    rank in a binary counter over its microbatches, summed over the source ranks at each power-of-two count."""

    def __init__(self, module: nn.Module, ignored: set[nn.Parameter], replicas: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.params = _managed(module, ignored)
        """The sharded parameters this module's fully_shard manages, as they are now, right after it sharded them:
        while the module is unsharded (reshard_after_backward=False, as torch's pipeline stage sets it) its
        attributes are the unsharded parameters, whose gradients are not the ones torch accumulates into."""
        self.replicas = replicas
        """HSDP's replicate group (a 2-D mesh's dimension 0), whose nodes complete the tree; None on a 1-D mesh."""
        self.force_sum = False
        """The user's `set_force_sum_reduction_for_comms`: torch then divides the output itself, after the hook."""
        self.unreduced: torch.Tensor | None = None
        """The reduce-scatter's input of the current microbatch (fully_shard allocates it first)."""
        self.divide_factor: float | None = None
        """The user's `set_gradient_divide_factor`, applied to each contribution as torch does at one shard."""
        self.stacks: list[list[tuple[int, torch.Tensor]]] = []
        """Per source rank: (leaves, partial sum) for each open node of its counter, oldest first."""
        self.count = 0
        """Microbatches received this step."""
        self.pending: torch.Tensor | None = None
        """The all-to-all's output [W, shard] of the current microbatch, until the hook sums it."""
        self.average = False
        """Whether torch asked for the average over the W ranks (its op without a divide factor)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        buffer = super().allocate(size, dtype=dtype, device=device)
        if self.unreduced is None:  # the input, then the output: at one shard the hook reads the input, since
            self.unreduced = buffer  # HSDP all-reduces the output over the replicas (in its order) before the hook
        return buffer

    def _receive(self, received: torch.Tensor, output: torch.Tensor, op: object) -> None:
        """Keep the microbatch's contributions for the all-reduce hook, which fully_shard calls next."""
        if self.divide_factor is not None:  # as at one shard, where torch divides the copied gradient
            received = received / self.divide_factor
        self.average = self.divide_factor is None and op == dist.ReduceOp.AVG
        self.pending = received

    def after_reduce(self, output: torch.Tensor) -> None:
        """fully_shard's all-reduce hook, called with the shard after every microbatch's reduction (at one shard,
        the copied gradient): push the contributions, write the tree's sum so far, and have fully_shard assign the
        shard to the gradients instead of adding it to them."""
        received, self.pending = self.pending, None
        unreduced, self.unreduced = self.unreduced, None
        if received is None:  # one shard: torch copied the gradient (its input) into the output, no reduce-scatter
            assert unreduced is not None, "fully_shard allocates the reduce-scatter's input before the hook"
            received = unreduced.detach().clone().view(1, -1)
            if self.divide_factor is not None:  # as torch divides the copy
                received = received / self.divide_factor
            # torch's average over the replicas (its all-reduce's op, as torch picks it for these dtypes)
            self.average = (self.replicas is not None and self.replicas.size() > 1 and self.divide_factor is None
                            and not self.force_sum and received.dtype in (torch.float32, torch.bfloat16))
        world = received.shape[0]
        if not self.stacks:
            self.stacks = [[] for _ in range(world)]
        elif self.stacks[0][0][1].numel() != received.shape[1]:
            raise UsageError("detrace.parallel.fully_shard: a parameter got no gradient in one of a step's "
                             "microbatches; every parameter of a sharded module must take part in every backward")
        for stack, row in zip(self.stacks, received, strict=True):
            stack.append((1, row))  # a view of a buffer of our own: the counter adds into it in place
            while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
                size, right = stack.pop()
                stack[-1][1].add_(right)  # left + right: the same two operands at every world size
                stack[-1] = (2 * size, stack[-1][1])
        self.count += 1
        if self.count & (self.count - 1) == 0:  # a power of two: each source's counter is one node of the tree
            nodes = [[stack[0][1].clone()] for stack in self.stacks]
            total = _tree_sum(nodes)[0]  # the node of this replica's microbatches
            replicas = 1
            if self.replicas is not None:  # HSDP: the tree above the replicas' nodes, in its fixed order
                replicas = self.replicas.size()
                total = _exchange([total], group=self.replicas, rank=dist.get_rank(self.replicas), world=replicas,
                                  how="auto", donate=True)[0]
            if self.average:
                total = total / (world * replicas)  # exact for powers of two, as the 1 / n of the loss
            output.copy_(total)
        else:  # between two nodes: zeros, not what the allocation held (the bits of a gradient read mid-step)
            output.zero_()
        for param in self.params:
            param.grad = None  # fully_shard then assigns the shard instead of adding it to the previous sum


def _managed(module: nn.Module, ignored: set[nn.Parameter]) -> tuple[nn.Parameter, ...]:
    """The parameters `module`'s fully_shard manages: its subtree's, less nested FSDP modules' and the ignored ones."""
    from torch.distributed.fsdp import FSDPModule

    found: list[nn.Parameter] = []

    def walk(m: nn.Module) -> None:
        found.extend(p for p in m.parameters(recurse=False) if p not in ignored)
        for child in m.children():
            if not isinstance(child, FSDPModule):
                walk(child)

    walk(module)
    return tuple(found)


_COMMS: weakref.WeakSet[_TreeReduceScatter] = weakref.WeakSet()
_HOOKED = False


def _close_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global optimizer pre-hook: the optimizer's sharded modules' trees are complete (or refused), and the next
    backward starts a new step."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    comms = [c for c in _COMMS if c.count and any(id(p) in owned for p in c.params)]
    counts = {c.count for c in comms}
    for comm in comms:
        comm.count, comm.stacks = 0, []
    if any(count & (count - 1) for count in counts):
        raise UsageError(f"detrace.parallel.fully_shard: a module received {max(counts)} microbatches in a step; "
                         "each rank must run a power-of-two number of microbatches per optimizer step")
    if len(counts) > 1:
        raise UsageError(f"detrace.parallel.fully_shard: the sharded modules received {sorted(counts)} "
                         "microbatches in one step; every module must take part in every microbatch's backward")


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise UsageError(f"detrace.parallel.fully_shard does not support {what}")
    return refused


def fully_shard(module: nn.Module, *, mesh: Any = None, **options: Any) -> nn.Module:
    """torch.distributed.fsdp.fully_shard(module, mesh=..., **options), whose gradients are the same bits at every
    number of shards (see the module's docstring for the loop's contract and what is refused)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    global _HOOKED
    if not isinstance(module, nn.Module):
        raise UsageError("detrace.parallel.fully_shard takes one module, not a list: call it once per module")
    if mesh is not None and mesh.ndim not in (1, 2):
        raise UsageError("detrace.parallel.fully_shard takes a 1-D mesh, or a 2-D one for HSDP (replicate, shard), "
                         f"not a {mesh.ndim}-D one")
    if options.get("dp_mesh_dims") is not None:
        raise UsageError("detrace.parallel.fully_shard does not support dp_mesh_dims: pass a 1-D mesh, or a 2-D one "
                         "for HSDP (replicate, shard)")
    sharded = torch_fully_shard(module, mesh=mesh, **options)  # `module` itself, its class now torch's FSDP one
    replicas = mesh.get_group(0) if mesh is not None and mesh.ndim == 2 else None  # torch's HSDP: dim 0 replicates
    comm = _TreeReduceScatter(module, set(options.get("ignored_params") or ()), replicas)
    try:
        sharded.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]  # torch types it as its private base
        sharded.set_all_reduce_hook(comm.after_reduce)
    except ValueError as error:  # several parameter groups (per-parameter meshes from shard_placement_fn)
        raise UsageError("detrace.parallel.fully_shard does not support parameters on several meshes "
                         "(shard_placement_fn returning meshes)") from error
    torch_set_factor = sharded.set_gradient_divide_factor

    def set_gradient_divide_factor(factor: float) -> None:
        comm.divide_factor = factor
        torch_set_factor(factor)

    torch_set_force_sum = sharded.set_force_sum_reduction_for_comms

    def set_force_sum_reduction_for_comms(enable: bool) -> None:
        comm.force_sum = enable
        torch_set_force_sum(enable)

    def keep_syncing(requires: bool, *, recurse: bool = True) -> None:
        """set_requires_gradient_sync and set_requires_all_reduce: each microbatch's gradient is still reduced (the
        tree takes each one alone; accumulated unreduced, they would be added in running order), so skipping the
        sync between microbatches is accepted and changes nothing: the gradient after the step's last microbatch is
        torch's, without the communication it would have saved."""

    # Instance attributes shadow the class's methods, for this module only (nn.Module keeps plain values there).
    object.__setattr__(sharded, "set_gradient_divide_factor", set_gradient_divide_factor)
    object.__setattr__(sharded, "set_force_sum_reduction_for_comms", set_force_sum_reduction_for_comms)
    object.__setattr__(sharded, "set_requires_gradient_sync", keep_syncing)
    object.__setattr__(sharded, "set_requires_all_reduce", keep_syncing)
    object.__setattr__(sharded, "set_custom_reduce_scatter", _refuse("a custom reduce-scatter (it has its own)"))
    object.__setattr__(sharded, "set_all_reduce_hook", _refuse("an all-reduce hook (it has its own)"))
    _COMMS.add(comm)
    if not _HOOKED:
        register_optimizer_step_pre_hook(_close_steps)
        _HOOKED = True
    return module
