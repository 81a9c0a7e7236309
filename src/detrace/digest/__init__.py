"""Bit-exact, order-sensitive fingerprints of tensors (`detrace.fingerprint`, `detrace.fingerprint_many`).

This module holds the public entry points; the package is one module per concern:

- `scheme`: the definitions of ``detrace-fp1`` and ``detrace-fp2`` and why they have their guarantees, in NumPy;
  the `Fingerprint` record.
- `inputs`: what can be fingerprinted (tensors, component objects, chunks) and its logical bytes.
- `kernels`: the PyTorch kernels (eager, compiled) and which scheme and kernel run (``DETRACE_FINGERPRINT_SCHEME``,
  ``DETRACE_FINGERPRINT_BACKEND``).
- `native`: the loaders of the C kernels for the CPU (`detrace._fp1`, `detrace._fp2`); `_triton`: fp2 on GPUs.
- `plan`: batches: packing pieces into row buffers, partial sums per device, one read-back per device.
- `sharded`: a DTensor's fingerprint, its global tensor's, from the shards without gathering them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from detrace._compat import quiet_dispatch_modes
from detrace.digest.inputs import (
    check_chunks,
    chunk_dim,
    component_meta,
    components_of,
    dtype_name,
    logical_bytes,
    part_chunks,
    plain,
)
from detrace.digest.kernels import BACKENDS, SCHEME_NAMES, selected_backend, selected_scheme
from detrace.digest.kernels import ENV_BACKEND as ENV_BACKEND  # re-exported: the variable users set
from detrace.digest.kernels import ENV_SCHEME as ENV_SCHEME
from detrace.digest.plan import Planner, StagedFingerprints, collect, one_native
from detrace.digest.scheme import SCHEME, SCHEME2, Fingerprint, add, combine, header, np_bytes_sum
from detrace.digest.sharded import global_fingerprints, is_dtensor
from detrace.errors import UsageError

__all__ = [
    "BACKENDS",
    "SCHEME",
    "SCHEME2",
    "Fingerprint",
    "StagedFingerprints",
    "collect",
    "fingerprint",
    "fingerprint_many",
    "reference_fingerprint",
    "stage",
]


@contextlib.contextmanager
def _quiet_modes() -> Iterator[None]:
    """Fingerprinting observes tensors: no autograd, and no active dispatch mode may see or fake our ops."""
    with torch.no_grad(), quiet_dispatch_modes():
        yield


def scheme_named(scheme: str | None) -> str:
    """The full name of a scheme given as fp1/fp2/detrace-fp1/detrace-fp2, or the selected one for None."""
    if scheme is None:
        return selected_scheme()
    if scheme not in SCHEME_NAMES:
        raise UsageError(f"fingerprint scheme {scheme!r} is not one of fp1, fp2")
    return SCHEME_NAMES[scheme]


def stage(tensors: Sequence[Any], *, chunks: int | None = None, dim: int = 0,
          scheme: str | None = None) -> StagedFingerprints:
    """Start fingerprinting `tensors` on their devices; read the results later with `.result()`/`collect`.

    `chunks`, `dim` and `scheme` apply to every tensor (see `fingerprint`).
    """
    check_chunks(chunks, dim)
    name = scheme_named(scheme)
    backend = selected_backend()
    if backend == "reference":
        return StagedFingerprints([], {}, [], [], [reference_fingerprint(t, chunks=chunks, dim=dim, scheme=name)
                                                   for t in tensors], scheme=name)
    planner = Planner(backend, name)
    with _quiet_modes():
        return planner.stage([planner.add(t, chunks, dim) for t in tensors])


def fingerprint_many(tensors: Sequence[Any], *, chunks: int | None = None, dim: int = 0,
                     scheme: str | None = None) -> list[Fingerprint]:
    """Fingerprints of many tensors, computed on their devices and read back in one transfer per device. A DTensor's
    is its global tensor's (see `fingerprint`): collective, with one all-reduce per mesh for all of them."""
    sharded = [i for i, t in enumerate(tensors) if is_dtensor(t)]
    if not sharded:
        return stage(tensors, chunks=chunks, dim=dim, scheme=scheme).result()
    if chunks is not None:
        raise UsageError("chunk digests of a DTensor are not computed: fingerprint its local shard "
                         "(DTensor.to_local()) with chunks, or the DTensor without")
    name = scheme_named(scheme)
    out: list[Fingerprint | None] = [None] * len(tensors)
    for i, fp in zip(sharded, global_fingerprints([tensors[i] for i in sharded], name), strict=True):
        out[i] = fp
    rest = [i for i in range(len(tensors)) if out[i] is None]
    for i, fp in zip(rest, stage([tensors[i] for i in rest], scheme=name).result(), strict=True):
        out[i] = fp
    return [fp for fp in out if fp is not None]


def fingerprint(tensor: Any, *, chunks: int | None = None, dim: int = 0, scheme: str | None = None) -> Fingerprint:
    """The fingerprint of one tensor: a 64-bit digest of its bits, shape and dtype.

    With `chunks=N`, dimension `dim` is split into N near-equal chunks (as `torch.tensor_split`; N at least
    the size of `dim` gives one chunk per row/token), and `Fingerprint.chunks` holds the digest of each
    chunk: the digest that `fingerprint` gives for that slice on its own. A tensor or object implementing
    `__detrace_components__()` is fingerprinted as its components. `scheme` (``"fp1"`` or ``"fp2"``) overrides
    ``DETRACE_FINGERPRINT_SCHEME`` (fp1 when unset); digests of different schemes are never comparable.

    A DTensor's fingerprint is its global tensor's (that of `full_tensor()`, bit for bit), computed from the shards
    without gathering them (`detrace.digest.sharded`): a collective, which every rank of its mesh must call.
    """
    check_chunks(chunks, dim)
    if chunks is None and is_dtensor(tensor):
        return global_fingerprints([tensor], scheme_named(scheme))[0]
    if chunks is None:
        name = scheme_named(scheme)
        # Only dispatch modes to quiet: the in-place path builds no autograd graph (plain() detaches), and no_grad's
        # few microseconds are a tenth of a 1 MiB call.
        with quiet_dispatch_modes():
            fast = one_native(tensor, selected_backend(), name)
        if fast is not None:
            return fast
    return fingerprint_many([tensor], chunks=chunks, dim=dim, scheme=scheme)[0]


# ---------------------------------------------------------------------------------------------------------
# The reference implementation: one tensor at a time, NumPy on a host copy, read straight off the definition


def _reference_digest(t: torch.Tensor, scheme: str) -> int:
    data = logical_bytes(t).cpu().numpy()
    return add(np_bytes_sum(data, scheme), header(dtype_name(t.dtype), tuple(t.shape), scheme), scheme)


def reference_fingerprint(tensor: Any, *, chunks: int | None = None, dim: int = 0,
                          scheme: str | None = None) -> Fingerprint:
    """Same result as `fingerprint`, computed by the slow, simple reference path (for tests and audits)."""
    check_chunks(chunks, dim)
    name = scheme_named(scheme)
    with _quiet_modes():
        parts = components_of(tensor)
        if parts is not None:
            children = tuple(
                (str(part_name), reference_fingerprint(part, chunks=part_chunks(part, chunks, dim), dim=dim,
                                                       scheme=name))
                for part_name, part in parts.items()
            )
            dtype, shape = component_meta(tensor)
            return Fingerprint(combine(dtype, shape, children, name), dtype, shape, math.prod(shape),
                               components=children, scheme=name)
        t = plain(tensor)
        digest = _reference_digest(t, name)
        if chunks is None:
            return Fingerprint(digest, dtype_name(t.dtype), tuple(t.shape), t.numel(), scheme=name)
        dim = chunk_dim(t, dim)
        pieces = torch.tensor_split(t, min(chunks, t.shape[dim]), dim=dim) if t.shape[dim] else ()
        return Fingerprint(digest, dtype_name(t.dtype), tuple(t.shape), t.numel(),
                           tuple(_reference_digest(p, name) for p in pieces), dim, scheme=name)
