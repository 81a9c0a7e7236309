"""Bit-exact, order-sensitive fingerprints of tensors (`detrace.fingerprint`, `detrace.fingerprint_many`).

This module holds the public entry points; the package is one module per concern:

- `scheme`: the definition of ``detrace-fp1`` and why it has its guarantees, in NumPy; the `Fingerprint` record.
- `inputs`: what can be fingerprinted (tensors, component objects, chunks) and its logical bytes.
- `kernels`: the PyTorch kernels (eager, compiled) and which kernel runs (``DETRACE_FINGERPRINT_BACKEND``).
- `native`: the loader of the C kernel for the CPU (`detrace._fp1`).
- `plan`: batches: packing pieces into row buffers, partial sums per device, one read-back per device.
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
from detrace.digest.kernels import BACKENDS, selected_backend
from detrace.digest.kernels import ENV_BACKEND as ENV_BACKEND  # re-exported: the variable users set
from detrace.digest.plan import Planner, StagedFingerprints, collect
from detrace.digest.scheme import M64, SCHEME, Fingerprint, combine, header, np_bytes_sum

__all__ = [
    "BACKENDS",
    "SCHEME",
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


def stage(tensors: Sequence[Any], *, chunks: int | None = None, dim: int = 0) -> StagedFingerprints:
    """Start fingerprinting `tensors` on their devices; read the results later with `.result()`/`collect`.

    `chunks` and `dim` apply to every tensor (see `fingerprint`).
    """
    check_chunks(chunks, dim)
    backend = selected_backend()
    if backend == "reference":
        return StagedFingerprints([], {}, [], [], [reference_fingerprint(t, chunks=chunks, dim=dim) for t in tensors])
    planner = Planner(backend)
    with _quiet_modes():
        return planner.stage([planner.add(t, chunks, dim) for t in tensors])


def fingerprint_many(tensors: Sequence[Any], *, chunks: int | None = None, dim: int = 0) -> list[Fingerprint]:
    """Fingerprints of many tensors, computed on their devices and read back in one transfer per device."""
    return stage(tensors, chunks=chunks, dim=dim).result()


def fingerprint(tensor: Any, *, chunks: int | None = None, dim: int = 0) -> Fingerprint:
    """The fingerprint of one tensor: a 64-bit digest of its bits, shape and dtype.

    With `chunks=N`, dimension `dim` is split into N near-equal chunks (as `torch.tensor_split`; N at least
    the size of `dim` gives one chunk per row/token), and `Fingerprint.chunks` holds the digest of each
    chunk: the digest that `fingerprint` gives for that slice on its own. A tensor or object implementing
    `__detrace_components__()` is fingerprinted as its components.
    """
    return fingerprint_many([tensor], chunks=chunks, dim=dim)[0]


# ---------------------------------------------------------------------------------------------------------
# The reference implementation: one tensor at a time, NumPy on a host copy, read straight off the definition


def _reference_digest(t: torch.Tensor) -> int:
    data = logical_bytes(t).cpu().numpy()
    return (np_bytes_sum(data) + header(dtype_name(t.dtype), tuple(t.shape))) & M64


def reference_fingerprint(tensor: Any, *, chunks: int | None = None, dim: int = 0) -> Fingerprint:
    """Same result as `fingerprint`, computed by the slow, simple reference path (for tests and audits)."""
    check_chunks(chunks, dim)
    with _quiet_modes():
        parts = components_of(tensor)
        if parts is not None:
            children = tuple(
                (str(name), reference_fingerprint(part, chunks=part_chunks(part, chunks, dim), dim=dim))
                for name, part in parts.items()
            )
            dtype, shape = component_meta(tensor)
            return Fingerprint(combine(dtype, shape, children), dtype, shape, math.prod(shape),
                               components=children)
        t = plain(tensor)
        digest = _reference_digest(t)
        if chunks is None:
            return Fingerprint(digest, dtype_name(t.dtype), tuple(t.shape), t.numel())
        dim = chunk_dim(t, dim)
        pieces = torch.tensor_split(t, min(chunks, t.shape[dim]), dim=dim) if t.shape[dim] else ()
        return Fingerprint(digest, dtype_name(t.dtype), tuple(t.shape), t.numel(),
                           tuple(_reference_digest(p) for p in pieces), dim)
