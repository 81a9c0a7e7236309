"""The fingerprint of a DTensor: the fingerprint of the global tensor, computed from the shards without gathering.

The scheme is a keyed sum over the words of the global tensor's bytes (`detrace.digest.scheme`): a word's term
depends only on its bits and its global position. So each rank adds the terms of the words it holds, keyed at
their global positions, and one all-reduce of two words per tensor over the DTensor's mesh completes the sum; the
zero padding of the last row and the header are added on every rank after it. The result is the fingerprint of
`tensor.full_tensor()`, bit for bit, on every rank, and the same whatever the placements.

- A rank's shard is a box of the global tensor (`Shard` and `Replicate` placements, even or uneven, on meshes of
  any dimension): in C order, runs of contiguous elements of one length, at global offsets computed here.
- A replica (a mesh dimension the tensor is replicated on) is counted once: by the ranks at coordinate 0 there.
- Two cases fall back to gathering (`full_tensor()`, the same bits at the cost of one whole tensor per rank): a run
  that starts or ends inside a word (8 bytes: an odd number of half-precision elements per run, as a bfloat16
  tensor of odd row length sharded on dimension 1), decided together by all ranks; and placements that are not a box
  (`_StridedShard`, fully_shard of a tensor-parallel weight).
- A `Partial` DTensor has no global value until it is reduced: refused.

Collective: every rank of the mesh must fingerprint the same DTensors in the same order (as it must call any
DTensor collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from detrace._compat import dtensor_local_box, quiet_dispatch_modes
from detrace.digest.inputs import dtype_name, logical_bytes, plain
from detrace.digest.kernels import _torch_mix32, _torch_mix_, _torch_rowkeys, device_tables
from detrace.digest.scheme import (
    COL_BITS,
    M32,
    M64,
    MIXA,
    MIXB,
    ROW_BYTES,
    ROW_WORDS,
    SCHEME,
    Fingerprint,
    add,
    header,
    np_rowkeys2,
)
from detrace.errors import FingerprintError

WORD = 8
"""Bytes per word of both schemes' rows (fp2 reads each as two 32-bit lanes)."""
BLOCK_WORDS = 1 << 20
"""Words keyed and mixed at once: bounds the temporaries to a few times 8 MiB, whatever the shard's size."""


def is_dtensor(obj: Any) -> bool:
    """Whether `obj` is a DTensor (by name: importing torch.distributed.tensor costs every run a second)."""
    return type(obj).__name__ == "DTensor" and hasattr(obj, "to_local")


def _runs(shape: tuple[int, ...], local: tuple[int, ...], offset: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """The box `local` at `offset` of a C-order tensor of `shape`, as runs of contiguous elements: (the global
    element index where each run starts, in the box's own C order; the elements per run)."""
    if not shape:
        return np.zeros(1, dtype=np.int64), 1
    k = len(shape) - 1
    while k > 0 and local[k] == shape[k]:  # the dimensions inside the run are whole
        k -= 1
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    starts = np.array(offset[k] * strides[k], dtype=np.int64)
    for j in range(k):
        starts = np.add.outer(starts, (offset[j] + np.arange(local[j], dtype=np.int64)) * strides[j])
    # np.add.outer puts each later dimension last: the C order of the box's outer indices
    return np.asarray(starts, dtype=np.int64).reshape(-1), local[k] * strides[k]


def _terms(words: torch.Tensor, index: torch.Tensor, scheme: str) -> torch.Tensor:
    """The sum of the terms of int64 `words` at global word positions `index`, as int64 [2]: the low and high 32
    bits of fp1's sum mod 2**64, or fp2's two lane sums mod 2**32 (each fits a word's sum over ranks)."""
    tables = device_tables(words.device)
    if scheme == SCHEME:
        keys = tables.colkeys[index & (ROW_WORDS - 1)] ^ _torch_rowkeys(index >> COL_BITS)
        total = _torch_mix_(words ^ keys).sum()
        return torch.stack([total & M32, (total >> 32) & M32])
    rows = index >> COL_BITS
    first = int(rows.min())
    rowkeys = torch.from_numpy(np_rowkeys2(np.arange(first, int(rows.max()) + 1)).view(np.int64)).to(words.device)
    keys = rowkeys[rows - first]
    lanes = words.view(torch.int32).to(torch.int64).view(-1, 2) & M32
    cols = ((index << 1) & (2 * ROW_WORDS - 1))[:, None] + torch.arange(2, device=words.device)
    sa = _torch_mix32(lanes ^ tables.colkeys2[0][cols] ^ (keys & M32)[:, None], MIXA).sum()
    sb = _torch_mix32(lanes ^ tables.colkeys2[1][cols] ^ ((keys >> 32) & M32)[:, None], MIXB).sum()
    return torch.stack([sa & M32, sb & M32])


def _sum_at(data: torch.Tensor, starts: np.ndarray, run_words: int, scheme: str) -> torch.Tensor:
    """The terms of `data` (int64 words, runs of `run_words` one after the other) whose runs start at global words
    `starts`, block by block, as `_terms`' int64 [2]."""
    total = torch.zeros(2, dtype=torch.int64, device=data.device)
    first = torch.from_numpy(starts).to(data.device)
    for lo in range(0, data.numel(), BLOCK_WORDS):
        flat = torch.arange(lo, min(lo + BLOCK_WORDS, data.numel()), dtype=torch.int64, device=data.device)
        index = first[flat // run_words] + flat % run_words
        total += _terms(data[flat], index, scheme)
    return total & M32


def _partial(tensor: Any, scheme: str, *, replicas: bool = False) -> tuple[torch.Tensor, bool]:
    """This rank's int64 [2] part of the global sum (zeros for a replica's copy unless `replicas`), and whether its
    runs fit whole words (when not, every rank falls back to gathering)."""
    local = plain(tensor.to_local())
    box, offset = dtensor_local_box(tensor)
    zeros = torch.zeros(2, dtype=torch.int64, device=local.device)
    if tuple(local.shape) != box:  # a shard other than torch's own computation of it: gather
        return zeros, False
    coordinate = tensor.device_mesh.get_coordinate() or []
    replica = any(type(p).__name__ == "Replicate" and c for p, c in zip(tensor.placements, coordinate, strict=True))
    if (replica and not replicas) or local.numel() == 0:
        return zeros, True
    size = local.element_size()
    starts, run = _runs(tuple(tensor.shape), box, offset)
    run_bytes, end = run * size, tensor.numel() * size
    aligned = not (starts * size % WORD).any() and (run_bytes % WORD == 0 or
                                                   (starts.size == 1 and int(starts[0]) * size + run_bytes == end))
    if not aligned:
        return zeros, False
    data = logical_bytes(local)
    if data.numel() % WORD:  # the global tensor's last word: zero padded, as the scheme pads it
        data = torch.cat([data, torch.zeros(WORD - data.numel() % WORD, dtype=torch.uint8, device=data.device)])
    else:
        data = data.clone()  # word-aligned storage for the int64 view
    return _sum_at(data.view(torch.int64), starts * size // WORD, -(-run_bytes // WORD), scheme), True


def _padding(nbytes: int, device: torch.device, scheme: str) -> int:
    """The terms of the zero words that pad the global tensor's bytes to whole rows."""
    words, rows = -(-nbytes // WORD), -(-nbytes // ROW_BYTES)
    if rows * ROW_WORDS == words:
        return 0
    index = torch.arange(words, rows * ROW_WORDS, dtype=torch.int64, device=device)
    low, high = _terms(torch.zeros_like(index), index, scheme).tolist()
    return _join(low, high, scheme)


def _join(low: int, high: int, scheme: str) -> int:
    """A scheme's sum from the sums over ranks of its two 32-bit halves (see `_terms`)."""
    return (low + (high << 32)) & M64 if scheme == SCHEME else (low & M32) | (high & M32) << 32


def _boxed(tensor: Any) -> bool:
    """Whether every rank's shard is a box of the global tensor. A `_StridedShard(dim, sf)` (fully_shard over a
    tensor-parallel DTensor: FSDP shards each tp block's rows) is one when the later mesh dimensions that shard `dim`
    split it into exactly sf blocks: each rank then holds a contiguous part of one block."""
    sizes = tensor.device_mesh.shape
    for i, p in enumerate(tensor.placements):
        if type(p).__name__ == "_StridedShard":
            later = math.prod(sizes[j] for j, q in enumerate(tensor.placements)
                              if j > i and type(q).__name__ == "Shard" and q.dim == p.dim)
            if later != p.split_factor:
                return False
        elif type(p).__name__ not in ("Shard", "Replicate"):
            return False
    return True


def part_of(tensor: Any, scheme: str) -> Fingerprint | None:
    """This rank's part of a sharded DTensor's global fingerprint, with no collective: a Fingerprint whose digest is
    the sum of the terms of the words this rank holds, keyed at their global positions (a replica's copy included),
    whose shape is the global shape and whose numel is this rank's. The parts of the distinct shards, added with
    the scheme's addition, complete to the global fingerprint with `whole_digest`. None where there is no such part:
    a DTensor this rank holds whole (no placement shards it, a mesh of one, or an uneven shard that leaves the other
    ranks empty, as a [1, 8] weight over 2 ranks: fingerprint it, that is the global fingerprint), placements that
    are not a box, or runs that split a word. What the tracer records of a DTensor (docs/topology.md)."""
    if not _boxed(tensor) or not any(type(p).__name__ == "Shard" for p in tensor.placements):
        return None
    numel = math.prod(dtensor_local_box(tensor)[0])
    if numel == tensor.numel():  # the whole tensor (a mesh of one): its own fingerprint is the global one
        return None
    part, aligned = _partial(tensor, scheme, replicas=True)
    if not aligned:
        return None
    low, high = part.tolist()
    return Fingerprint(_join(low, high, scheme), dtype_name(tensor.dtype), tuple(tensor.shape), numel, scheme=scheme)


def whole_digest(parts: Sequence[int], dtype: torch.dtype, shape: tuple[int, ...], scheme: str) -> int:
    """The global fingerprint's digest from the `part_of` digests of the distinct shards (each box once)."""
    total = 0
    for part in parts:
        total = add(total, part, scheme)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return add(add(total, _padding(nbytes, torch.device("cpu"), scheme), scheme),
               header(dtype_name(dtype), shape, scheme), scheme)


def _reduce(values: torch.Tensor, mesh: Any) -> None:
    """Sum `values` over every rank of `mesh`: one all-reduce per mesh dimension."""
    for dim in range(mesh.ndim):
        dist.all_reduce(values, group=mesh.get_group(dim))


def global_fingerprints(tensors: Sequence[Any], scheme: str) -> list[Fingerprint]:
    """The fingerprints of DTensors as those of their global tensors (see the module doc): one all-reduce per mesh
    dimension for all of them that share a mesh. Collective over their meshes."""
    for t in tensors:
        if any(type(p).__name__ == "Partial" for p in t.placements):
            raise FingerprintError("cannot fingerprint a DTensor with a Partial placement: it has no global value "
                                   "until it is reduced (redistribute it to Replicate or Shard first)")
    boxed = [_boxed(t) for t in tensors]
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    by_mesh: dict[int, list[int]] = {}
    with torch.no_grad(), quiet_dispatch_modes():
        for i, t in enumerate(tensors):
            if boxed[i]:
                part, aligned = _partial(t, scheme)
                sums[i] = torch.cat([part, torch.tensor([0 if aligned else 1], device=part.device)])
                by_mesh.setdefault(id(t.device_mesh), []).append(i)
        for indices in by_mesh.values():
            stacked = torch.stack([sums[i] for i in indices])  # type: ignore[misc]
            _reduce(stacked, tensors[indices[0]].device_mesh)
            for i, row in zip(indices, stacked, strict=True):
                sums[i] = row
        out = []
        for t, total in zip(tensors, sums, strict=True):
            shape = tuple(t.shape)
            if total is None or int(total[2]):  # not a box, or some rank's runs split a word: gather
                from detrace.digest import fingerprint

                out.append(fingerprint(t.full_tensor(), scheme=scheme))
                continue
            nbytes = t.numel() * t.element_size()
            digest = _join(int(total[0]), int(total[1]), scheme)
            digest = add(add(digest, _padding(nbytes, total.device, scheme), scheme),
                         header(dtype_name(t.dtype), shape, scheme), scheme)
            out.append(Fingerprint(digest, dtype_name(t.dtype), shape, t.numel(), scheme=scheme))
        return out
