"""The few collectives a checkpoint needs, that also work without a process group (one process)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

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


def _device() -> torch.device:
    """Where this process group's collectives take their tensors."""
    # NCCL reduces only device tensors; any backend that offers gloo (alone or in a "cpu:gloo,cuda:nccl" pair)
    # reduces CPU tensors.
    backend = str(dist.get_backend())
    return torch.device("cpu") if "gloo" in backend else torch.device("cuda", torch.cuda.current_device())


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on at least one rank, so that every rank takes the same branch."""
    if not active():
        return flag
    value = torch.tensor([int(flag)], device=_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def differs(value: int) -> bool:
    """Whether `value` (a 64-bit digest) is not the same on every rank; False without a process group."""
    if not active():
        return False
    low = value & ((1 << 62) - 1)  # non-negative in int64, so that its negation is too
    both = torch.tensor([low, -low], dtype=torch.int64, device=_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]) != -int(both[1])  # the largest differs from the smallest


def from_rank0(value: int) -> int:
    """Rank 0's `value` (a 64-bit integer), on every rank; `value` itself without a process group."""
    if not active():
        return value
    signed = value - (1 << 64) if value >= 1 << 63 else value  # int64 holds it
    tensor = torch.tensor([signed], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src=0)
    return int(tensor.item()) % (1 << 64)


def _json_bytes(value: object) -> torch.Tensor:
    """`value` as JSON bytes (no pickle), a uint8 tensor where this process group's collectives take it."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(_device())


def _from_json_bytes(data: torch.Tensor) -> Any:
    """What `_json_bytes` made `data` of."""
    return json.loads(data.cpu().numpy().tobytes())


def json_from_rank0(value: T) -> T:
    """Rank 0's `value` (what `json.dumps` takes, as `json.loads` gives it back), on every rank; `value` itself
    without a process group. One broadcast of its length and one of its bytes; the other ranks' `value` is not
    read."""
    if not active():
        return value
    rank0 = dist.get_rank() == 0
    data = _json_bytes(value) if rank0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=_device())
    dist.broadcast(size, src=0)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())
    dist.broadcast(data, src=0)
    return value if rank0 else _from_json_bytes(data)


def held_anywhere(flags: list[bool]) -> list[bool]:
    """For each item of a list that every rank holds alike, whether some rank's flag for it is true; `flags` itself
    without a process group."""
    if not active() or not flags:
        return flags
    value = torch.tensor(flags, dtype=torch.int32, device=_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return [bool(flag) for flag in value.tolist()]


def differing(digests: dict[str, int]) -> set[str]:
    """The keys of `digests` (name -> 64-bit digest of a value this rank holds) whose value some other rank holds
    with another digest; empty without a process group. Ranks may hold different keys (pipeline stages): a key
    only one rank holds differs from nothing."""
    if not active():
        return set()
    # One all-gather of every rank's digests as JSON bytes, padded to the longest.
    mine = _json_bytes(digests)
    sizes = [torch.zeros(1, dtype=torch.int64, device=_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=_device()))
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=_device())
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    theirs = [_from_json_bytes(row[: int(size.item())]) for row, size in zip(gathered, sizes, strict=True)]
    return {key for key, digest in digests.items() if any(other.get(key, digest) != digest for other in theirs)}


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
