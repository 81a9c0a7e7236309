"""What can be fingerprinted, and its logical bytes: plain tensors, component objects, chunks along a dimension.

A tensor enters the scheme as its elements in C order as bytes (never its storage, strides or device). An object
made of several tensors (a quantized tensor, or anything implementing ``__detrace_components__()``) enters as
its named components. Everything else is refused with one sentence that says what to fingerprint instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import Any

import torch

from detrace._compat import disable_torch_function_subclass, is_functorch_wrapped
from detrace.digest.scheme import ROW_BYTES
from detrace.errors import FingerprintError, UsageError


@cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_protocol_methods: dict[type, Callable[[Any], Any] | None] = {}


def components_of(obj: Any) -> Mapping[str, Any] | None:
    kind = type(obj)
    try:
        method = _protocol_methods[kind]
    except KeyError:
        method = _protocol_methods[kind] = getattr(kind, "__detrace_components__", None)
    if method is not None:
        parts = method(obj)
        if not isinstance(parts, Mapping) or not parts:
            raise FingerprintError(
                f"{type(obj).__name__}.__detrace_components__() must return a non-empty dict of tensors"
            )
        return parts
    if isinstance(obj, torch.Tensor) and obj.is_quantized:
        return _quantized_components(obj)
    return None


def _quantized_components(t: torch.Tensor) -> dict[str, torch.Tensor]:
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return {"int_repr": t.int_repr(), "scale": torch.tensor(t.q_scale(), dtype=torch.float64),
                "zero_point": torch.tensor(t.q_zero_point(), dtype=torch.int64)}
    if scheme in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams):
        return {"int_repr": t.int_repr(), "scales": t.q_per_channel_scales(),
                "zero_points": t.q_per_channel_zero_points(),
                "axis": torch.tensor(t.q_per_channel_axis(), dtype=torch.int64)}
    raise FingerprintError(f"quantized tensors with qscheme {scheme} cannot be fingerprinted")


def plain(t: Any) -> torch.Tensor:
    """A plain strided tensor with real data and the same logical content as `t`, or FingerprintError."""
    if not isinstance(t, torch.Tensor):
        raise FingerprintError(
            f"cannot fingerprint a {type(t).__name__}: expected a torch.Tensor or an object with "
            "__detrace_components__()"
        )
    kind = type(t)
    if kind is not torch.Tensor and kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise FingerprintError(
            f"cannot fingerprint a {kind.__name__}: this tensor subclass holds no plain data; implement "
            "__detrace_components__() on it or fingerprint its local data (e.g. DTensor.to_local())"
        )
    if t.is_meta:
        raise FingerprintError("cannot fingerprint a meta tensor: it has a shape and a dtype but no data")
    if t.layout != torch.strided:
        raise FingerprintError(
            f"cannot fingerprint a tensor with layout {t.layout}: fingerprint t.to_dense() or its parts"
        )
    if t.is_nested:
        raise FingerprintError("cannot fingerprint a nested tensor: fingerprint its components")
    if is_functorch_wrapped(t):
        raise FingerprintError(
            "cannot fingerprint a tensor inside vmap/grad transforms: it has no single logical value"
        )
    if kind is not torch.Tensor:
        with disable_torch_function_subclass():
            t = t.detach()
    elif t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous tensor (the last dimension grows by the element size)."""
    try:
        return t.view(torch.uint8)
    except (RuntimeError, NotImplementedError) as err:
        raise FingerprintError(f"cannot read the bytes of a {dtype_name(t.dtype)} tensor: {err}") from None


def logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in C order as a 1-D uint8 tensor on its device (a view when possible)."""
    return bytes_of(t.contiguous().reshape(-1))


def as_rows(data: torch.Tensor, nrows: int) -> torch.Tensor | None:
    """The first nrows*4096 bytes of 1-D uint8 `data` as an int64 [nrows, 512] view, or None if misaligned."""
    if data.data_ptr() % 8:
        return None
    return data[: nrows * ROW_BYTES].view(nrows, ROW_BYTES).view(torch.int64)


# ---------------------------------------------------------------------------------------------------------
# Chunk-wise mode and component objects


def check_chunks(chunks: int | None, dim: int) -> None:
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise UsageError(f"chunks must be a positive integer or None, not {chunks!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise UsageError(f"dim must be an integer, not {dim!r}")


def chunk_dim(t: torch.Tensor, dim: int) -> int:
    """`dim` as a non-negative dimension of `t`, or UsageError."""
    if t.dim() == 0:
        raise UsageError("chunk-wise fingerprints need a tensor with at least one dimension")
    if not -t.dim() <= dim < t.dim():
        raise UsageError(f"dim {dim} is out of range for a tensor with {t.dim()} dimensions")
    return dim % t.dim()


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """Near-equal chunk sizes, as torch.tensor_split: the first (length % n) chunks are one longer."""
    n = min(chunks, length)
    if n == 0:
        return []
    q, r = divmod(length, n)
    return [q + 1] * r + [q] * (n - r)


def chunk_groups(t: torch.Tensor, dim: int, sizes: list[int]) -> Iterator[tuple[torch.Tensor, int, int]]:
    """Yield (uint8 [m, chunk_bytes] block, chunk size, m) for each run of equal-sized chunks along dim."""
    outer = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1 :])
    start = 0
    i = 0
    while i < len(sizes):
        size = sizes[i]
        m = 1
        while i + m < len(sizes) and sizes[i + m] == size:
            m += 1
        part = t.narrow(dim, start, m * size).reshape(outer, m, size, inner).transpose(0, 1)
        yield bytes_of(part.reshape(m, outer * size * inner).contiguous()), size, m
        start += m * size
        i += m


def part_chunks(part: Any, chunks: int | None, dim: int) -> int | None:
    """Chunk-wise mode reaches the components that have dimension `dim` (a per-tensor scale has none)."""
    ok = isinstance(part, torch.Tensor) and -part.dim() <= dim < part.dim()
    return chunks if ok else None


def component_meta(obj: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype, logical shape) of a component object: its `dtype` (a torch dtype or a format name) and `shape`."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
    else:
        name = dtype if isinstance(dtype, str) else type(obj).__name__
    return name, tuple(int(s) for s in getattr(obj, "shape", ()))
