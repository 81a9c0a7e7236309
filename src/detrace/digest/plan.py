"""Planning a batch: pieces of bytes -> row batches -> partial sums on the device, owners on the host.

`detrace.fingerprint_many` packs small tensors into shared row buffers (a few kernels for thousands of tensors),
computes partial sums on each tensor's device, and reads all of them back with one transfer per device.
`StagedFingerprints` holds a batch between the device part and the read-back; `collect` reads back many staged
batches at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from detrace.digest.inputs import (
    as_rows,
    bytes_of,
    chunk_dim,
    chunk_groups,
    chunk_sizes,
    component_meta,
    components_of,
    dtype_name,
    logical_bytes,
    part_chunks,
    plain,
)
from detrace.digest.kernels import COMPILE_MIN_WORDS, device_tables, kernel, native_kernel, runs_native
from detrace.digest.scheme import (
    ROW_BYTES,
    SPECS,
    Fingerprint,
    add,
    combine,
    header,
    np_accumulate,
    np_add,
    with_digest,
)

# Tensors from this size on are hashed in place (no copy) by the one-pass body kernel.
BODY_MIN_BYTES = 1 << 18
# Smaller tensors are copied into shared row buffers of up to about this size.
PACK_FLUSH_BYTES = 1 << 26
# Row widths (words) for pieces of at most one row (4096 bytes): such a piece is row 0 of its tensor, hashed
# in the narrowest of these widths that holds it; Z0 adds what the rest of the zero-padded row contributes.
_NARROW_WIDTHS = (8, 32, 128, 512)


def _narrow_width(nbytes: int) -> int:
    return next(w for w in _NARROW_WIDTHS if nbytes <= 8 * w)


class _DevicePlan:
    """Everything one device contributes to a batch: partial sums (device) and their owners (host)."""

    def __init__(self, device: torch.device, backend: str, scheme: str) -> None:
        self.device = device
        self.backend = backend
        self.scheme = scheme
        self.spec = SPECS[scheme]
        self.tables = device_tables(device)
        self.narrow: dict[int, list[tuple[torch.Tensor, int]]] = {w: [] for w in _NARROW_WIDTHS}
        self.packed: list[tuple[torch.Tensor, int, int]] = []  # (bytes, first row, owner)
        self.packed_bytes = 0
        self.results: list[torch.Tensor] = []  # int64 partial sums on the device
        self.host_results: list[np.ndarray] = []  # int64 partial sums computed on the host (NumPy)
        self.owners: list[np.ndarray] = []  # per result: which digest each partial sum belongs to
        self.host_owners: list[np.ndarray] = []

    def _use_numpy(self, words: int) -> bool:
        return self.device.type == "cpu" and self.backend == "auto" and words < COMPILE_MIN_WORDS

    def _emit(self, values: torch.Tensor | np.ndarray, owners: np.ndarray) -> None:
        if isinstance(values, np.ndarray):
            self.host_results.append(values)
            self.host_owners.append(owners)
        else:
            self.results.append(values)
            self.owners.append(owners)

    def _rows(self, words: torch.Tensor | np.ndarray, rowkeys: np.ndarray, owners: np.ndarray) -> None:
        """Row sums of words [N, W] (int64 on the device, or uint64 in NumPy) with host row keys (uint64 [N])."""
        if isinstance(words, np.ndarray) or self._use_numpy(words.numel()):
            host = words if isinstance(words, np.ndarray) else words.numpy().view(np.uint64)
            self._emit(self.spec.row_sums(host, rowkeys).view(np.int64), owners)
            return
        rk = torch.from_numpy(rowkeys.view(np.int64))
        if self.device.type == "cuda":  # pinned + non_blocking: the copy is queued, the host never waits
            rk = rk.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            rk = rk.to(self.device)
        self._emit(kernel("rows", words, rk, self.backend, self.scheme), owners)

    def add_bytes(self, data: torch.Tensor, owner: int, consts: list[int]) -> None:
        """Add S(data) to digest `owner` (data: 1-D uint8 on this device, the whole logical tensor)."""
        n = data.numel()
        if n == 0:
            return
        if n <= ROW_BYTES:
            width = _narrow_width(n)
            self.narrow[width].append((data, owner))
            consts[owner] = add(consts[owner], self.spec.z0[width], self.scheme)
            return
        if n < BODY_MIN_BYTES:
            self._pack(data, 0, owner)
            return
        body_rows = n // ROW_BYTES
        body = as_rows(data, body_rows)
        if body is None:  # storage offset not 8-byte aligned: hash an aligned copy
            body = as_rows(data[: body_rows * ROW_BYTES].clone(), body_rows)
        assert body is not None
        self._emit(kernel("total", body, self.tables.rowkeys(body_rows, self.scheme), self.backend, self.scheme),
                   np.array([owner], dtype=np.int64))
        if n > body_rows * ROW_BYTES:
            self._pack(data[body_rows * ROW_BYTES :], body_rows, owner)

    def _pack(self, data: torch.Tensor, first_row: int, owner: int) -> None:
        self.packed.append((data, first_row, owner))
        self.packed_bytes += data.numel()
        if self.packed_bytes >= PACK_FLUSH_BYTES:  # bound the copy that packing makes
            self._run_packed()

    def add_chunks(self, groups: list[tuple[torch.Tensor, list[int]]], consts: list[int]) -> None:
        """Each group is a uint8 [m, chunk_bytes] tensor whose rows are the bytes of m equal-sized chunks."""
        for block, owners in groups:
            m, nbytes = block.shape
            if nbytes == 0 or m == 0:
                continue
            owner_arr = np.asarray(owners, dtype=np.int64)
            if nbytes <= ROW_BYTES:
                width = _narrow_width(nbytes)
                words = torch.nn.functional.pad(block, (0, 8 * width - nbytes)).view(torch.int64)
                self._rows(words, np.full(m, self.spec.rk0, dtype=np.uint64), owner_arr)
                for o in owners:
                    consts[o] = add(consts[o], self.spec.z0[width], self.scheme)
                continue
            rows = -(-nbytes // ROW_BYTES)
            padded = torch.nn.functional.pad(block, (0, rows * ROW_BYTES - nbytes))
            words = padded.reshape(m * rows, ROW_BYTES).view(torch.int64)
            rowkeys = np.tile(self.spec.rowkeys(np.arange(rows)), m)
            self._rows(words, rowkeys, np.repeat(owner_arr, rows))

    def finish(self) -> None:
        """Run the shared row batches (narrow buckets and packed rows)."""
        zeros = self.tables.zeros
        for width, items in self.narrow.items():
            if not items:
                continue
            stride = 8 * width
            words: torch.Tensor | np.ndarray
            if self._use_numpy(len(items) * width):  # small CPU batch: assemble it in NumPy directly
                buffer = np.zeros((len(items), stride), dtype=np.uint8)
                for i, (data, _) in enumerate(items):
                    buffer[i, : data.numel()] = data.numpy()
                words = buffer.view(np.uint64)
            else:
                parts: list[torch.Tensor] = []
                for data, _ in items:
                    parts.append(data)
                    if data.numel() < stride:
                        parts.append(zeros[: stride - data.numel()])
                words = torch.cat(parts).view(len(items), stride).view(torch.int64)
            owners = np.fromiter((o for _, o in items), dtype=np.int64, count=len(items))
            self._rows(words, np.full(len(items), self.spec.rk0, dtype=np.uint64), owners)
        self._run_packed()
        self.narrow = {w: [] for w in _NARROW_WIDTHS}

    def _run_packed(self) -> None:
        """Hash the packed pieces: each padded to whole rows, keyed from its first row on, in one buffer."""
        if not self.packed:
            return
        zeros = self.tables.zeros
        parts = []
        counts = np.empty(len(self.packed), dtype=np.int64)
        firsts = np.empty(len(self.packed), dtype=np.int64)
        owners = np.empty(len(self.packed), dtype=np.int64)
        for i, (data, first, owner) in enumerate(self.packed):
            n = data.numel()
            rows = -(-n // ROW_BYTES)
            parts.append(data)
            if rows * ROW_BYTES > n:
                parts.append(zeros[: rows * ROW_BYTES - n])
            counts[i], firsts[i], owners[i] = rows, first, owner
        words = torch.cat(parts).view(-1, ROW_BYTES).view(torch.int64)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        row_numbers = np.arange(counts.sum(), dtype=np.int64) - starts + np.repeat(firsts, counts)
        self._rows(words, self.spec.rowkeys(row_numbers), np.repeat(owners, counts))
        self.packed = []
        self.packed_bytes = 0


class _OneLayout(NamedTuple):
    """What `one_native` needs of a tensor's dtype and shape, the same for every tensor of them (cached)."""

    nbytes: int
    """The size of its logical bytes."""
    rowkeys: np.ndarray
    """The row keys of its rows (a view of the device table's)."""
    colkeys: np.ndarray
    """The column keys of the scheme's native kernel."""
    header: int
    """`scheme.header` of its dtype and shape."""
    record: Fingerprint
    """Its Fingerprint but the digest (digest 0): the result is `with_digest(record, ...)`."""


# Layouts of (dtype, shape, scheme) seen by `one_native` (None: below BODY_MIN_BYTES); emptied when this full, so that
# a stream of ever-new shapes does not grow it without bound.
_ONE_LAYOUTS_MAX = 4096
_one_layouts: dict[tuple[torch.dtype, torch.Size, str], _OneLayout | None] = {}


def _one_layout(t: torch.Tensor, scheme: str) -> _OneLayout | None:
    if t.numel() * t.element_size() < BODY_MIN_BYTES:
        return None
    nbytes = bytes_of(t.contiguous()).numel()  # as `logical_bytes` counts them, or its FingerprintError
    dtype, shape = dtype_name(t.dtype), tuple(t.shape)
    tables = device_tables(t.device)
    return _OneLayout(nbytes, tables.host_rowkeys(-(-nbytes // ROW_BYTES), scheme), tables.host_colkeys(scheme),
                      header(dtype, shape, scheme), Fingerprint(0, dtype, shape, t.numel(), scheme=scheme))


def one_native(obj: Any, backend: str, scheme: str) -> Fingerprint | None:
    """The fingerprint of one plain CPU tensor of at least BODY_MIN_BYTES by the native kernel, or None where the
    planner applies (anything else: chunks are the caller's to rule out).

    The same sums as the planner's body path and its packed tail row, without a batch's bookkeeping (device plans,
    owners, the read-back), in one C call (`_Kernel.total_at`: the rows where they lie, at any alignment, and the
    zero-padded tail row): on one core a 1 MiB call took ~150 us through the planner and ~86 us through per-row
    sums, a copy of the tail and a NumPy total; the kernel ~45 us of it. Each 1 MiB pass evicts the interpreter's
    data from the L2, so every object made and call left per fingerprint costs misses: what depends only on the
    dtype and shape (row keys, header, the record) is cached, and the C call reads the bytes at the tensor's address
    (no uint8 view, no NumPy array). Python's share of a 1 MiB bfloat16 call went from 24 us to 11 us there (from 11
    to 5 us warm, measured with a kernel that returns at once).
    """
    if components_of(obj) is not None:
        return None
    t = plain(obj)
    if not t.is_cpu or not runs_native(backend, scheme):
        return None
    key = (t.dtype, t.shape, scheme)
    try:
        layout = _one_layouts[key]
    except KeyError:
        if len(_one_layouts) >= _ONE_LAYOUTS_MAX:
            _one_layouts.clear()
        layout = _one_layouts[key] = _one_layout(t, scheme)
    if layout is None:
        return None
    t = t.contiguous()  # held until the C call returns: it reads the bytes at t.data_ptr()
    total = native_kernel(scheme).total_at(t.data_ptr(), layout.nbytes, layout.rowkeys, layout.colkeys,
                                           torch.get_num_threads())
    return with_digest(layout.record, add(total, layout.header, scheme))


@dataclass
class _Node:
    """A fingerprint waiting for its numbers: digest/chunk slots, or components."""

    dtype: str
    shape: tuple[int, ...]
    numel: int
    slot: int = -1
    chunk_slots: tuple[int, ...] | None = None
    chunk_dim: int | None = None
    components: tuple[tuple[str, _Node], ...] = ()


class StagedFingerprints:
    """Fingerprints whose partial sums are computed (or queued) on the devices but not yet read back.

    Holding one keeps only small int64 tensors alive, never the fingerprinted tensors themselves (except
    through copies already made). `result()` reads back once per device; `collect` reads many at once.
    """

    def __init__(self, nodes: list[_Node], plans: dict[torch.device, _DevicePlan], headers: list[int],
                 consts: list[int], result: list[Fingerprint] | None = None, *, scheme: str) -> None:
        self.scheme = scheme
        self._nodes = nodes
        self._plans = plans
        self._headers = headers
        self._consts = consts
        self._result = result

    def __len__(self) -> int:
        return len(self._result) if self._result is not None else len(self._nodes)

    def result(self) -> list[Fingerprint]:
        if self._result is None:
            collect([self])
        assert self._result is not None
        return self._result

    def _finish(self, device_sums: Mapping[torch.device, np.ndarray]) -> None:
        acc = np.zeros(len(self._headers), dtype=np.uint64)
        for device, plan in self._plans.items():
            if plan.owners:
                np_accumulate(acc, np.concatenate(plan.owners), device_sums[device].view(np.uint64), self.scheme)
            if plan.host_owners:
                np_accumulate(acc, np.concatenate(plan.host_owners),
                              np.concatenate(plan.host_results).view(np.uint64), self.scheme)
        for constants in (self._headers, self._consts):
            np_add(acc, np.array(constants, dtype=np.uint64), self.scheme)
        digests = [int(v) for v in acc]
        self._result = [_resolve(node, digests, self.scheme) for node in self._nodes]
        self._plans = {}


def _resolve(node: _Node, digests: list[int], scheme: str) -> Fingerprint:
    if node.components:
        parts = tuple((name, _resolve(child, digests, scheme)) for name, child in node.components)
        return Fingerprint(combine(node.dtype, node.shape, parts, scheme), node.dtype, node.shape, node.numel,
                           components=parts, scheme=scheme)
    chunks = None if node.chunk_slots is None else tuple(digests[s] for s in node.chunk_slots)
    return Fingerprint(digests[node.slot], node.dtype, node.shape, node.numel, chunks, node.chunk_dim,
                       scheme=scheme)


def collect(staged: Sequence[StagedFingerprints]) -> list[list[Fingerprint]]:
    """Read back many staged batches with one device->host transfer per device; returns their results."""
    pending = [s for s in staged if s._result is None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for s in pending:
        for device, plan in s._plans.items():
            by_device.setdefault(device, []).extend(plan.results)
    values: list[dict[torch.device, np.ndarray]] = [{} for _ in pending]
    for device, tensors in by_device.items():
        host = torch.cat(tensors).cpu().numpy() if tensors else np.zeros(0, dtype=np.int64)
        offset = 0
        for i, s in enumerate(pending):
            own = s._plans.get(device)
            if own is not None:
                count = sum(t.numel() for t in own.results)
                values[i][device] = host[offset : offset + count]
                offset += count
    for s, device_values in zip(pending, values, strict=True):
        s._finish(device_values)
    return [s.result() for s in staged]


class Planner:
    """Turns the inputs of one batch into digest slots (one per digest and per chunk) and device plans."""

    def __init__(self, backend: str, scheme: str) -> None:
        self.backend = backend
        self.scheme = scheme
        self.plans: dict[torch.device, _DevicePlan] = {}
        self.headers: list[int] = []
        self.consts: list[int] = []

    def _slot(self, head: int) -> int:
        self.headers.append(head)
        self.consts.append(0)
        return len(self.headers) - 1

    def _plan(self, device: torch.device) -> _DevicePlan:
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = _DevicePlan(device, self.backend, self.scheme)
        return plan

    def add(self, obj: Any, chunks: int | None, dim: int) -> _Node:
        parts = components_of(obj)
        if parts is not None:
            return self._add_components(obj, parts, chunks, dim)
        t = plain(obj)
        dtype = dtype_name(t.dtype)
        shape = tuple(t.shape)
        node = _Node(dtype, shape, t.numel(), slot=self._slot(header(dtype, shape, self.scheme)))
        plan = self._plan(t.device)
        plan.add_bytes(logical_bytes(t), node.slot, self.consts)
        if chunks is not None:
            dim = chunk_dim(t, dim)
            sizes = chunk_sizes(t.shape[dim], chunks)
            slots: list[int] = []
            groups = []
            for block, size, m in chunk_groups(t, dim, sizes):
                chunk_shape = (*shape[:dim], size, *shape[dim + 1 :])
                owners = [self._slot(header(dtype, chunk_shape, self.scheme)) for _ in range(m)]
                slots.extend(owners)
                groups.append((block, owners))
            plan.add_chunks(groups, self.consts)
            node.chunk_slots, node.chunk_dim = tuple(slots), dim
        return node

    def _add_components(self, obj: Any, parts: Mapping[str, Any], chunks: int | None, dim: int) -> _Node:
        children = tuple((str(name), self.add(part, part_chunks(part, chunks, dim), dim))
                         for name, part in parts.items())
        dtype, shape = component_meta(obj)
        return _Node(dtype, shape, math.prod(shape), components=children)

    def stage(self, nodes: list[_Node]) -> StagedFingerprints:
        for plan in self.plans.values():
            plan.finish()
        return StagedFingerprints(nodes, self.plans, self.headers, self.consts, scheme=self.scheme)
