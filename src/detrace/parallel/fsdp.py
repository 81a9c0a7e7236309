"""FSDP (`fully_shard`) whose gradients' bits do not depend on the number of shards.

`fully_shard` sums the ranks' gradients in its reduce-scatter, in an order that depends on the number of ranks
(and on the collective's algorithm), and accumulates microbatches in the order they ran. Here the global batch is
M microbatches, rank r of W owns the block [r M/W, (r + 1) M/W) (as in `detrace.parallel.data`), and every
microbatch's backward runs with gradient sync on, so fully_shard hands each microbatch's unsharded gradient to its
reduce-scatter. `FixedOrderReduceScatter` replaces that collective (fully_shard's `set_custom_reduce_scatter`):

- it moves the data without adding anything: an all-to-all gives rank r every rank's contribution to shard r;
- it keeps them until the rank's last microbatch, then sums the M contributions to shard r in the fixed balanced
  binary tree over the global microbatch indices: the tree of `InvariantDataParallel`.

Every addition is the same two operands at every W (an element of the shard is the same element of the whole
gradient), so shard r holds the bits of the same rows of the gradient that one process computes with M
microbatches of accumulation, or DDP-invariant at any W. The trainer clears the sharded gradients before each
microbatch (`invariant_backward(..., sharded=True)`), so fully_shard assigns the last one's output instead of
adding to the zeros the earlier ones output. At one shard fully_shard never calls the reduce-scatter (it copies
the gradient into the shard): its all-reduce hook, called after every reduction, runs the same tree there.

Data-parallel replicas of the sharded model (HSDP, a dpDxfsdpF layout): replica d's F ranks own the contiguous
microbatches [d M/D, (d + 1) M/D), one node of the tree, which their reduce-scatter sums; the D replicas' shards
then complete the tree above those nodes with `InvariantDataParallel`'s fixed-order exchange (`replicas`, instead of
fully_shard's all-reduce over the replicate dimension, whose order depends on D): every rank of shard f ends with
the same bits, the tree over all M.

What it gives up against fully_shard's own reduce-scatter: the same bytes move (each rank sends W - 1 shards and
receives W - 1), but one collective per microbatch instead of one per step under gradient accumulation, M shards
of memory until the tree completes, and the additions run after the rank's last microbatch instead of inside the
collective (on a GPU, NCCL's reduce-scatter adds while it moves data; here the tree runs after the last
all-to-all, on the reduce-scatter stream, still overlapped with the backward of the layers before).

    for module in (*model.layers, model):
        fully_shard(module, mesh=mesh)
    shard_invariantly(model, microbatches=M // W)         # every FSDPModule in the model
    invariant_backward(model, loss_of, microbatches=M, group=mesh.get_group(), sharded=True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from detrace.errors import UsageError
from detrace.parallel.data import _exchange, _tree_sum

__all__ = ["FixedOrderReduceScatter", "check_complete", "shard_invariantly"]

AllToAll = Callable[[torch.Tensor, dist.ProcessGroup], torch.Tensor]
"""Takes this rank's reduce-scatter input [W * n] (row s for rank s) and the group, returns [W * n] whose row s is
rank s's row for this rank. A parameter so that tests can simulate the ranks in one process."""


def _all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    received = torch.empty_like(tensor)
    dist.all_to_all_single(received, tensor, group=group)
    return received


class _AllToAllReduceScatter:
    """fully_shard's reduce-scatter for one FSDP module as an all-to-all that moves data without adding anything:
    rank r receives every rank's contribution to shard r, and `_receive` (each subclass's) sums them in its fixed
    order. It has the two methods of fully_shard's `ReduceScatter` interface (`allocate`, `__call__`), whose base
    class torch keeps in a private module.

    Args:
        exchange: the all-to-all (default: `torch.distributed.all_to_all_single`).
    """

    def __init__(self, exchange: AllToAll = _all_to_all) -> None:
        self.exchange = exchange

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = None, async_op: bool = False) -> dist.Work | None:
        self._receive(self.exchange(input_tensor, group).view(group.size(), -1), output_tensor, op)
        return None  # (synchronous: no Work for fully_shard to wait on)

    def _receive(self, received: torch.Tensor, output: torch.Tensor, op: object) -> None:
        """One microbatch's contributions [W, shard] (row s from rank s), torch's `output` for this shard and its
        reduce op."""
        raise NotImplementedError


class FixedOrderReduceScatter(_AllToAllReduceScatter):
    """fully_shard's reduce-scatter for one FSDP module, as the fixed tree over global microbatches.

    Args:
        microbatches: n, the microbatches this rank computes per step (M / W); the n-th call of a step completes
            the tree and writes the shard's sum, the earlier ones write zeros.
        exchange: the all-to-all (default: `torch.distributed.all_to_all_single`).
        replicas: the group of this shard's data-parallel replicas (HSDP), whose partial sums complete the tree;
            None: no replicas.
    """

    def __init__(self, microbatches: int, exchange: AllToAll = _all_to_all,
                 replicas: dist.ProcessGroup | None = None) -> None:
        if microbatches < 1:
            raise UsageError(f"microbatches per rank must be positive, not {microbatches}")
        super().__init__(exchange)
        self.microbatches, self.replicas = microbatches, replicas
        self.received: list[torch.Tensor] = []
        """This step's contributions so far: [W, shard] per microbatch, row s from rank s."""
        self.called = False
        """Whether fully_shard called the reduce-scatter since its last all-reduce hook (`after_reduce`)."""

    def _receive(self, received: torch.Tensor, output: torch.Tensor, op: object) -> None:
        # `op` is fully_shard's SUM (its gradient divide factor is 1: the loss is scaled by the global batch).
        self.called = True
        self._contribute(received, output, received.shape[0])

    def after_reduce(self, output: torch.Tensor) -> None:
        """fully_shard's all-reduce hook, called with the shard after every reduction. At one shard fully_shard
        never calls the reduce-scatter (it copies the gradient into the shard, which the trainer clears before each
        microbatch): this microbatch's gradient is then the one contribution, and the tree runs here."""
        if self.called:  # the reduce-scatter ran: the shard is already this step's tree or zeros
            self.called = False
            return
        self._contribute(output.clone().view(1, -1), output, 1)

    def _contribute(self, received: torch.Tensor, output: torch.Tensor, world: int) -> None:
        """Keep one microbatch's contributions [W, shard]; at the rank's last microbatch write the tree's sum
        into `output`, before it zeros."""
        self.received.append(received)
        if len(self.received) == self.microbatches:
            shard = self.reduce(world)
            if self.replicas is not None:  # the tree above the replicas' nodes, in its fixed order
                shard = _exchange([shard], group=self.replicas, rank=dist.get_rank(self.replicas),
                                  world=dist.get_world_size(self.replicas), how="auto")[0]
            output.copy_(shard)
        else:
            output.zero_()

    def reduce(self, world: int) -> torch.Tensor:
        """The tree over the M = W n contributions to this shard: global microbatch s n + k is rank s's k-th."""
        received, self.received = self.received, []
        leaves = [[received[k][s]] for s in range(world) for k in range(self.microbatches)]
        return _tree_sum(leaves)[0]


def check_complete(comms: Sequence[FixedOrderReduceScatter]) -> None:
    """After a step's backwards: refuse a step in which some FSDP module's tree did not complete (a module that a
    microbatch did not use gets no reduce-scatter call, and its shard would take the next step's contributions)."""
    pending = [c for c in comms if c.received]
    if pending:
        got = len(pending[0].received)
        for comm in comms:
            comm.received = []
        raise UsageError(f"an FSDP module received {got} of its {pending[0].microbatches} microbatches' gradients "
                         "in a step: every module must take part in every microbatch's backward")


def shard_invariantly(model: nn.Module, *, microbatches: int, exchange: AllToAll = _all_to_all,
                      replicas: dist.ProcessGroup | None = None) -> list[FixedOrderReduceScatter]:
    """Give every FSDP module of `model` (after `fully_shard`) a `FixedOrderReduceScatter` for `microbatches`
    microbatches per rank and per step (completed over the data-parallel `replicas`, if any), and a gradient divide
    factor of 1. Returns them, for `check_complete`."""
    from torch.distributed.fsdp import FSDPModule  # imported here: importing detrace.parallel stays light

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise UsageError("the model has no fully_shard module: call fully_shard first")
    comms = []
    for module in modules:
        comm = FixedOrderReduceScatter(microbatches, exchange, replicas)
        comms.append(comm)
        # mypy, ignored below: the parameter is typed as the interface's base class, private to torch; fully_shard
        # only calls allocate and __call__, which FixedOrderReduceScatter has
        module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
        module.set_all_reduce_hook(comm.after_reduce)  # at one shard the reduce-scatter is never called
        module.set_gradient_divide_factor(1.0)
    return comms
