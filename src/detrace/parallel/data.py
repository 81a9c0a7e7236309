"""Data parallelism whose bits do not depend on the number of ranks: a fixed-order gradient reduction.

The global batch is a fixed sequence of M microbatches (M chosen by the user, independent of the world size W).
Each microbatch's gradient is computed alone, with the same shapes at every W, and the gradients are summed in
one fixed balanced binary tree over the microbatch indices 0..M-1:

- rank r of W (W a power of two dividing M) owns the contiguous block [r M/W, (r + 1) M/W), which is one node
  of the tree; it sums its block's subtree locally, in tree order, as the gradients arrive (a stack of partial
  sums, one per level: about log2(M/W) buffers);
- the ranks complete the tree with an exchange whose order is fixed: recursive doubling over point-to-point
  (round k pairs the blocks r and r xor 2^k, both sides add the lower block to the higher one) or an all-gather
  of the W partial sums followed by the same tree on every rank. Both give the same bits; `exchange="auto"`
  picks per size (see `GATHER_MAX_BYTES`).

Every addition in the tree is the same two operands at every W (floating-point addition is commutative, so
either side of a pair computes the same bits), hence the same result on every rank and at every W, including
W = 1 with M microbatches of accumulation and W = M.

Randomness is per microbatch: each step draws one seed from the global CPU generator (the same draw on every
rank at every W) and runs microbatch i under a generator seeded from (that seed, i), restored afterwards, so
dropout or router jitter in microbatch i do not depend on which rank runs it.

The exchange uses `torch.distributed.isend`/`irecv` or `all_gather_single` on the given group (gloo,
NCCL): they are the user's collectives, seen by detrace's tracer like any other.

    idp = InvariantDataParallel(model, microbatches=8)
    for batch in loader:                                  # the same global batch on every rank
        idp.backward(lambda i: loss_fn(model(x[i]), y[i]) / global_tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

`invariant_backward(model, loss_of, microbatches=M)` is the same step as one function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from detrace.errors import UsageError

__all__ = ["EXCHANGES", "InvariantDataParallel", "invariant_backward", "owned_microbatches", "parameters_fingerprint"]

EXCHANGES = ("auto", "doubling", "gather")
"""How the ranks complete the tree: recursive doubling over p2p, an all-gather of the partial sums, or by size."""

GATHER_MAX_BYTES = 1 << 16
"""`exchange="auto"` all-gathers a partial sum of at most this many bytes and uses recursive doubling above it:
the all-gather is one collective (less latency) but moves (W - 1) partial sums where doubling moves log2(W).
bench/topology.py on gloo (docs/topology.md): a wash up to 64 KiB, doubling ahead from 1 MiB (2-6x at 16 MiB)."""

LossOf = Callable[[int], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]

_SEED_BOUND = 1 << 62


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise UsageError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def owned_microbatches(microbatches: int, group: dist.ProcessGroup | None = None) -> range:
    """The global microbatch indices this rank computes: a contiguous block of microbatches / W."""
    rank, world = _world(group)
    _check_sizes(microbatches, world)
    per = microbatches // world
    return range(rank * per, (rank + 1) * per)


def _check_sizes(microbatches: int, world: int) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise UsageError(f"microbatches must be a positive integer, not {microbatches!r}")
    if world & (world - 1):
        raise UsageError(f"invariant data parallelism needs a power-of-two world size, not {world}")
    if microbatches % world:
        raise UsageError(f"{microbatches} microbatches do not split evenly over {world} ranks")


def _split(lo: int, hi: int) -> int:
    """Where the tree splits the node [lo, hi): its middle (halves when the size is even)."""
    return lo + (hi - lo) // 2


def _tree_plan(lo: int, hi: int) -> list[int]:
    """The post-order of the tree over leaves [lo, hi), as the number of additions due after each leaf.

    Summing leaves in order with a stack, after leaf k the top `plan[k]` pairs are combined (left + right):
    that evaluates exactly the tree whose node [a, b) splits at `_split(a, b)`.
    """
    plan = [0] * (hi - lo)

    def walk(a: int, b: int) -> None:
        if b - a == 1:
            return
        m = _split(a, b)
        walk(a, m)
        walk(m, b)
        plan[b - 1 - lo] += 1  # the node [a, b) completes with its last leaf

    walk(lo, hi)
    return plan


def _tree_sum(leaves: Sequence[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Sum lists of buffers in the fixed tree over their indices (the same tree `_Accumulator` streams)."""
    acc = _Accumulator(len(leaves))
    for leaf in leaves:
        acc.push(leaf)
    return acc.result()


class _Accumulator:
    """Streams leaves (lists of flat buffers, one per bucket) into the tree's sum, keeping one partial sum per
    open level of the tree."""

    def __init__(self, leaves: int) -> None:
        self.plan = _tree_plan(0, leaves)
        self.stack: list[list[torch.Tensor]] = []
        self.seen = 0

    def push(self, leaf: list[torch.Tensor]) -> None:
        self.stack.append(leaf)
        for _ in range(self.plan[self.seen]):
            right = self.stack.pop()
            for left_buf, right_buf in zip(self.stack[-1], right, strict=True):
                left_buf.add_(right_buf)  # left + right: the same two operands at every world size
        self.seen += 1

    def result(self) -> list[torch.Tensor]:
        assert self.seen == len(self.plan) and len(self.stack) == 1, "the tree is not complete"
        return self.stack[0]


@dataclass(frozen=True)
class _Bucket:
    """The entries (gradients, then logged values) of one dtype and device, flattened into one buffer."""

    dtype: torch.dtype
    device: torch.device
    entries: tuple[int, ...]
    """Indices into the step's entry list."""
    sizes: tuple[int, ...]


def _buckets(templates: Sequence[torch.Tensor]) -> list[_Bucket]:
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(templates):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return [_Bucket(dtype, device, tuple(idx), tuple(templates[i].numel() for i in idx))
            for (dtype, device), idx in groups.items()]


def _flatten(buckets: list[_Bucket], tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """One flat buffer per bucket; a missing gradient (a parameter this microbatch did not use) is zeros."""
    flats = []
    for b in buckets:
        parts = []
        for i, n in zip(b.entries, b.sizes, strict=True):
            t = tensors[i]
            parts.append(torch.zeros(n, dtype=b.dtype, device=b.device) if t is None else t.detach().reshape(-1))
        flats.append(torch.cat(parts))
    return flats


def _exchange(flats: list[torch.Tensor], *, group: dist.ProcessGroup | None, rank: int, world: int,
              how: str, donate: bool = False) -> list[torch.Tensor]:
    """Complete the tree above the W blocks: every rank ends with the root, the same bits on each.

    `donate`: `flats` are the caller's to give up, and recursive doubling adds into them in place (else its first
    round writes new buffers)."""
    if world == 1:
        return flats
    nbytes = sum(f.numel() * f.element_size() for f in flats)
    if how == "gather" or (how == "auto" and nbytes <= GATHER_MAX_BYTES):
        gathered = []
        for flat in flats:
            out = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
            _all_gather(out, flat, group)
            gathered.append(out.view(world, -1).unbind(0))
        return _tree_sum([[g[r] for g in gathered] for r in range(world)])  # the rows are ours: summed in place
    received = [torch.empty_like(f) for f in flats]  # one receive buffer per bucket, for every round
    for k in range(world.bit_length() - 1):  # round k: blocks r and r xor 2^k, each 2^k ranks' subtree
        partner = rank ^ (1 << k)
        peer = partner if group is None else dist.get_global_rank(group, partner)
        for flat, other in zip(flats, received, strict=True):
            # The lower rank sends first, the higher receives first: matched order, no grouping needed (NCCL).
            if rank < partner:
                works = [dist.isend(flat, peer, group=group), dist.irecv(other, peer, group=group)]
            else:
                works = [dist.irecv(other, peer, group=group), dist.isend(flat, peer, group=group)]
            for work in works:
                assert work is not None  # a member of the group always gets its Work
                work.wait()
        lower, upper = (flats, received) if rank < partner else (received, flats)
        # lower block + upper block, in that order on both sides (a NaN's payload follows the operands' order)
        flats = [torch.add(a, b, out=mine) if donate or k else a + b
                 for a, b, mine in zip(lower, upper, flats, strict=True)]
    return flats


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """`out` = every rank's `tensor`, in rank order. all_gather_single where this torch has it (it deprecates
    all_gather_into_tensor); looked up at each call, where a tracer may have wrapped it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)


def step_seed() -> int:
    """The step's one draw from the global generator (the same on every rank at every layout)."""
    return int(torch.randint(0, _SEED_BOUND, (), dtype=torch.int64))


def microbatch_seed(base: int, i: int) -> int:
    """The seed of global microbatch i's generators in the step whose draw is `base`."""
    return (base + i * 0x9E3779B97F4A7C15) % _SEED_BOUND


@contextlib.contextmanager
def _microbatch_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run under generators seeded from `seed`, then give the global generators their state back."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else "cpu"):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield


def invariant_backward(model: nn.Module | Sequence[nn.Parameter], loss_of: LossOf, *, microbatches: int,
                       group: dist.ProcessGroup | None = None, exchange: str = "auto", sharded: bool = False
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One step's gradients, the same bits at every world size: run `loss_of(i).backward()` for each global
    microbatch i this rank owns, sum the gradients in the fixed tree and exchange them. Afterwards every
    parameter's `.grad` holds the sum over all M microbatches (replacing what it held), on every rank.

    `loss_of(i)` computes microbatch i's loss, already scaled by a global constant (e.g. divided by the global
    batch's token count, never by a per-rank count), optionally with a 1-D tensor of values to log:
    `(loss, values)`. Returns the tree sum over all M microbatches of the detached losses, and of the values
    when given: the same on every rank and at every world size. Collective over `group` (default: the world).

    `sharded`: the model is `fully_shard`ed with `detrace.parallel.fsdp.shard_invariantly`, whose reduce-scatter
    sums the gradients in the same tree; here each microbatch only starts from cleared (sharded) gradients, and the
    losses and values are summed.
    """
    if exchange not in EXCHANGES:
        raise UsageError(f"exchange {exchange!r} must be one of {', '.join(EXCHANGES)}")
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    if not params:
        raise UsageError("the model has no parameter that requires a gradient")
    rank, world = _world(group)
    owned = owned_microbatches(microbatches, group)
    # One draw from the global generator per step, the same on every rank at every world size; microbatch i
    # runs under a generator seeded from it and i, so its randomness does not depend on the rank that runs it.
    base = step_seed()
    acc = _Accumulator(len(owned))
    buckets: list[_Bucket] | None = None
    with_values: bool | None = None
    for i in owned:
        for p in params:
            p.grad = None  # each microbatch's gradient alone: nothing to accumulate into
        with _microbatch_rng(microbatch_seed(base, i), params[0].device):
            out = loss_of(i)
            loss, values = out if isinstance(out, tuple) else (out, None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise UsageError(f"loss_of({i}) must return a scalar loss tensor (or a (loss, values) pair)")
            if with_values is not None and with_values != (values is not None):
                raise UsageError("loss_of returned values for some microbatches and not for others")
            with_values = values is not None
            loss.backward()
        extras = [loss.detach().reshape(1)] + ([values.detach().reshape(-1)] if values is not None else [])
        summed = [] if sharded else params
        entries: list[torch.Tensor | None] = [*(p.grad for p in summed), *extras]
        if buckets is None:
            buckets = _buckets([p if p.grad is None else p.grad for p in summed] + extras)
        acc.push(_flatten(buckets, entries))
    assert buckets is not None
    flats = _exchange(acc.result(), group=group, rank=rank, world=world, how=exchange, donate=True)
    results: list[torch.Tensor] = [torch.empty(0)] * (len(summed) + len(extras))
    for b, flat in zip(buckets, flats, strict=True):
        for i, part in zip(b.entries, flat.split(list(b.sizes)), strict=True):
            results[i] = part
    for p, g in zip(summed, results, strict=False):
        p.grad = g.view_as(p)  # a view of the summed buffer: no copy
    loss_sum = results[len(summed)].reshape(())
    return (loss_sum, results[len(summed) + 1]) if with_values else loss_sum


def _digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fingerprints of `tensors` as int64 bit patterns."""
    from detrace.digest import fingerprint_many

    return torch.tensor([fp.digest for fp in fingerprint_many(tensors)], dtype=torch.uint64).view(torch.int64)


def parameters_fingerprint(model: nn.Module) -> str:
    """One fingerprint (16 hex digits) of all of `model`'s parameters, in name order: the fingerprint of the
    vector of their fingerprints. A DTensor parameter (`fully_shard`, `parallelize_module`) enters as its global
    tensor's fingerprint, computed from the shards (`detrace.digest.sharded`): the same on every rank and layout, and
    a collective that every rank of its mesh calls."""
    from detrace.digest import fingerprint

    named = sorted((name, p.detach()) for name, p in model.named_parameters())
    return fingerprint(_digests([p for _, p in named])).hex


class InvariantDataParallel:
    """A model trained with data parallelism whose bits do not depend on the world size (see the module doc).

    Not an nn.Module wrapper: the model keeps its own parameter names and state dict (hand the model itself to
    the optimizer and to `detrace.TrainState`). Calling it calls the model.

    Args:
        model: the replicated model (the same parameters on every rank of `group`; checked here).
        microbatches: M, the microbatches of one global batch; a multiple of the world size.
        group: the data-parallel process group (default: the world).
        exchange: "auto", "doubling" or "gather" (see `EXCHANGES`).
    """

    def __init__(self, model: nn.Module, *, microbatches: int, group: dist.ProcessGroup | None = None,
                 exchange: str = "auto") -> None:
        if exchange not in EXCHANGES:
            raise UsageError(f"exchange {exchange!r} must be one of {', '.join(EXCHANGES)}")
        self.module, self.microbatches, self.group, self.exchange = model, microbatches, group, exchange
        self.owned = owned_microbatches(microbatches, group)
        """The global microbatch indices this rank computes, in order."""
        self._check_replicas()

    def _check_replicas(self) -> None:
        """Refuse replicas that start from different parameters (one all-gather of a fingerprint, once)."""
        world = _world(self.group)[1]
        if world == 1:
            return
        tensors = [p.detach() for p in self.module.parameters()]
        mine = _digests(tensors).to(tensors[0].device if tensors else None)
        every = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
        _all_gather(every, mine, self.group)
        rows = every.view(world, -1)
        differ = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
        if differ:
            raise UsageError(f"rank {differ[0]} of the data-parallel group holds other parameters than rank 0; "
                             "initialise every replica from the same seed or checkpoint")

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)

    def backward(self, loss_of: LossOf) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This step's forward and backward over the owned microbatches, and the exchange: see
        `invariant_backward`."""
        return invariant_backward(self.module, loss_of, microbatches=self.microbatches, group=self.group,
                                  exchange=self.exchange)
