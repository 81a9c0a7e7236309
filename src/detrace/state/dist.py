"""The few collectives a checkpoint needs, that also work without a process group (one process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from detrace.errors import CheckpointError, DetraceError

T = TypeVar("T")


def active() -> bool:
    """Whether this process is part of an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if active() else (0, 1)


def barrier() -> None:
    """Wait for every rank; nothing to wait for without a process group."""
    if active():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on at least one rank, so that every rank takes the same branch."""
    if not active():
        return flag
    # NCCL reduces only device tensors; any backend that offers gloo (alone or in a "cpu:gloo,cuda:nccl" pair)
    # reduces CPU tensors.
    backend = str(dist.get_backend())
    device = torch.device("cpu") if "gloo" in backend else torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def differs(value: int) -> bool:
    """Whether `value` (a 64-bit digest) is not the same on every rank; False without a process group."""
    if not active():
        return False
    backend = str(dist.get_backend())
    device = torch.device("cpu") if "gloo" in backend else torch.device("cuda", torch.cuda.current_device())
    low = value & ((1 << 62) - 1)  # non-negative in int64, so that its negation is too
    both = torch.tensor([low, -low], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]) != -int(both[1])  # the largest differs from the smallest


def together(
    action: Callable[[], T],
    *,
    elsewhere: str = "another rank failed to prepare its part of the checkpoint; see its error",
) -> T:
    """Run `action` on every rank; when it fails on any rank, raise on every rank, so that no rank goes on
    into a collective that the failed one will never join. The ranks where it succeeded raise a
    CheckpointError saying `elsewhere`."""
    error: DetraceError | None = None
    try:
        result = action()
    except DetraceError as err:
        error = err
    if any_rank(error is not None):
        raise error or CheckpointError(elsewhere)
    return result
