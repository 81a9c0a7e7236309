"""Bit-exact, order-sensitive fingerprints of tensors (`detrace.fingerprint`, `detrace.fingerprint_many`).

The digest (scheme ``detrace-fp1``) is defined on the tensor's logical bytes, so it depends only on bits,
shape and dtype, never on strides, storage offset, device, thread count or process:

1. Take the tensor's elements in C order as little-endian bytes and pad them with zero bytes to a multiple of
   4096. Read the result as rows of 512 unsigned 64-bit words ``w[r, c]``.
2. Key every position: ``K[r, c] = T[c] ^ RK(r)``. ``T[c]`` holds 55 fixed pseudo-random bits above the
   column number ``c`` (low 9 bits), and ``RK(r)`` is a bijection of the row number shifted left by 9 bits.
   So no two positions share a key.
3. ``S = sum over all words of mix(w[r, c] ^ K[r, c])  (mod 2**64)``, where ``mix`` is the murmur3 64-bit
   finalizer: xorshifts and multiplications by odd constants, a bijection of 64-bit words.
4. ``digest = (S + H(dtype, shape)) mod 2**64``, where ``H`` is an 8-byte BLAKE2b of the dtype name and the
   shape. Python's salted ``hash()`` is never used.

Why this gives the guarantees (docs/fingerprint.md has the long form):

- Integer addition mod 2**64 is associative and commutative, so any reduction order, thread count or
  device gives the same bits.
- A change confined to one 64-bit word changes ``mix(w ^ K)`` (a bijection) and so changes ``S`` by a
  nonzero amount mod 2**64: one flipped bit, one changed element of a dtype up to 8 bytes, and a swap of two
  elements that share a word always change the digest. Changes spread over several words change it except
  with probability about 2**-64.
- Positions enter through distinct keys ahead of a nonlinear mix, so permutations, transposes and adjacent
  swaps change the digest, and two equal changes at two positions do not cancel (XOR-folds such as
  ``torch.hash_tensor`` miss all three).
- Shape and dtype enter through ``H``: an empty tensor, an all-zero tensor and a zero scalar differ.

Three implementations compute the same bits, and the tests compare them:

- ``reference``: NumPy ``uint64`` arithmetic on a host copy, written to read like the definition above.
- ``eager``: the same arithmetic as PyTorch ``int64`` operations (two's-complement wrap-around) on the
  tensor's own device.
- ``compiled``: that eager function under ``torch.compile`` (one fused Inductor kernel on CPU, Triton on
  CUDA), compiled once per row width with a dynamic number of rows, cached on disk by Inductor.

- ``native``: on the CPU, the same loop in C, compiled when detrace is installed (`detrace.digest_cpu`).

``DETRACE_FINGERPRINT_BACKEND=reference|eager|compiled|native|auto`` picks one. The default, ``auto``, hashes
small CPU batches in NumPy and larger ones with the native kernel from the first call, so no step pauses for
torch.compile on the CPU. Where the native kernel was not built, and on other devices, it hashes with eager kernels
until this process has hashed enough (256 MiB) to earn back the one-time compile cost; from then on large
batches use the compiled kernels (eager again if compilation fails, with a warning).

Batches: `fingerprint_many` packs small tensors into shared row buffers (a few kernels for thousands of
tensors), computes partial sums on each tensor's device, and reads all of them back with one transfer per
device. `stage` does the device part only; `collect` reads back many staged batches at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
import torch

from detrace._compat import disable_torch_function_subclass, is_functorch_wrapped, mark_dynamic, quiet_dispatch_modes
from detrace.digest_cpu import kernel as cpu_kernel
from detrace.errors import FingerprintError, UsageError

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

SCHEME = "detrace-fp1"
BACKENDS = ("auto", "reference", "eager", "compiled", "native")
ENV_BACKEND = "DETRACE_FINGERPRINT_BACKEND"

ROW_WORDS = 512  # 64-bit words per row
ROW_BYTES = ROW_WORDS * 8  # 4096
_COL_BITS = 9  # log2(ROW_WORDS): the low bits of a key hold the column
_M64 = (1 << 64) - 1
_M55 = (1 << 55) - 1

# murmur3 fmix64 constants (odd, so each multiplication is a bijection mod 2**64)
_MIX_C1 = 0xFF51AFD7ED558CCD
_MIX_C2 = 0xC4CEB9FE1A85EC53
_MIX_SHIFT = 33
# row-key bijection on 55-bit numbers: add, multiply by odd constants, xorshift (all mod 2**55)
_RK_ADD = 0x2545F4914F6CDD1 & _M55
_RK_C1 = 0x5851F42D4C957F2D & _M55 | 1
_RK_C2 = 0x14057B7EF767814F & _M55 | 1
_RK_S1, _RK_S2 = 28, 29

# Work smaller than this (in 64-bit words) is not worth a compiled kernel; on CPU it runs in NumPy.
COMPILE_MIN_WORDS = 1 << 15
# `auto` compiles once this much work (words, 256 MiB) has been or would be hashed by the eager kernels.
AUTO_COMPILE_WORDS = 1 << 25
# Rows per step of the eager kernel on CPU (in words: 1 MiB of int64, cache-sized temporaries).
_EAGER_BLOCK_WORDS = 1 << 17
# Tensors from this size on are hashed in place (no copy) by the one-pass body kernel.
BODY_MIN_BYTES = 1 << 18
# Smaller tensors are copied into shared row buffers of up to about this size.
PACK_FLUSH_BYTES = 1 << 26
# Row widths (words) for pieces of at most one row (4096 bytes): such a piece is row 0 of its tensor, hashed
# in the narrowest of these widths that holds it; _Z0 adds what the rest of the zero-padded row contributes.
_NARROW_WIDTHS = (8, 32, 128, 512)


def _signed(x: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit `x`."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


# Column keys: 55 pseudo-random bits above the column number.
_T_U64 = np.array(
    [((_splitmix64(0xDE7_4ACE_0000 + c) >> _COL_BITS) << _COL_BITS) | c for c in range(ROW_WORDS)],
    dtype=np.uint64,
)


# ---------------------------------------------------------------------------------------------------------
# The definition in NumPy (uint64 arithmetic wraps mod 2**64)


def _np_mix(x: np.ndarray) -> np.ndarray:
    s = np.uint64(_MIX_SHIFT)
    x = x ^ (x >> s)
    x = x * np.uint64(_MIX_C1)
    x = x ^ (x >> s)
    x = x * np.uint64(_MIX_C2)
    return x ^ (x >> s)


def _np_rowkeys(rows: np.ndarray) -> np.ndarray:
    """RK(r) for an array of row numbers: a bijection of r < 2**55, shifted above the column bits."""
    m = np.uint64(_M55)
    x = (rows.astype(np.uint64) + np.uint64(_RK_ADD)) & m
    x = (x * np.uint64(_RK_C1)) & m
    x = x ^ (x >> np.uint64(_RK_S1))
    x = (x * np.uint64(_RK_C2)) & m
    x = x ^ (x >> np.uint64(_RK_S2))
    return x << np.uint64(_COL_BITS)


def _np_row_sums(words: np.ndarray, rowkeys: np.ndarray) -> np.ndarray:
    """Per-row sums (uint64, wrapping) of mix(w ^ T[c] ^ rk[r]) for words [N, W] and row keys [N]."""
    keys = _T_U64[None, : words.shape[1]] ^ rowkeys[:, None]
    return _np_mix(words ^ keys).sum(axis=1, dtype=np.uint64)


_RK0 = int(_np_rowkeys(np.zeros(1, dtype=np.int64))[0])
# _Z0[W]: what the zero padding in columns W..511 of row 0 adds, so a row-0 piece can be hashed W words wide.
_Z0 = [int(v) for v in np.concatenate([np.cumsum(_np_mix(_T_U64 ^ np.uint64(_RK0))[::-1], dtype=np.uint64)[::-1],
                                        np.zeros(1, dtype=np.uint64)])]


@lru_cache(maxsize=65536)
def _header(dtype: str, shape: tuple[int, ...]) -> int:
    text = f"{SCHEME}|{dtype}|{','.join(map(str, shape))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _np_bytes_sum(data: np.ndarray) -> int:
    """S for a 1-D uint8 array: pad to whole rows, key, mix, sum (the definition, step by step)."""
    if data.size == 0:
        return 0
    rows = -(-data.size // ROW_BYTES)
    padded = np.zeros(rows * ROW_BYTES, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view("<u8").reshape(rows, ROW_WORDS)
    return int(_np_row_sums(words, _np_rowkeys(np.arange(rows))).sum(dtype=np.uint64))


# ---------------------------------------------------------------------------------------------------------
# The public record


@dataclass(frozen=True)
class Fingerprint:
    """The fingerprint of one tensor (or of a quantized tensor, through its components)."""

    digest: int  # unsigned 64-bit
    dtype: str  # torch dtype name without "torch.", or the format name of a component object
    shape: tuple[int, ...]
    numel: int
    chunks: tuple[int, ...] | None = None  # chunk-wise mode: one digest per chunk along chunk_dim
    chunk_dim: int | None = None
    components: tuple[tuple[str, Fingerprint], ...] = ()  # quantized tensors: ("data", fp), ("scales", fp)

    @property
    def hex(self) -> str:
        return f"{self.digest:016x}"

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.hex} {self.dtype}[{shape}]"


# ---------------------------------------------------------------------------------------------------------
# Inputs: what can be fingerprinted, and its logical bytes


@cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_protocol_methods: dict[type, Callable[[Any], Any] | None] = {}


def _components_of(obj: Any) -> Mapping[str, Any] | None:
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


def _plain(t: Any) -> torch.Tensor:
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


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous tensor (the last dimension grows by the element size)."""
    try:
        return t.view(torch.uint8)
    except (RuntimeError, NotImplementedError) as err:
        raise FingerprintError(f"cannot read the bytes of a {_dtype_name(t.dtype)} tensor: {err}") from None


def _logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in C order as a 1-D uint8 tensor on its device (a view when possible)."""
    return _bytes_of(t.contiguous().reshape(-1))


def _as_rows(data: torch.Tensor, nrows: int) -> torch.Tensor | None:
    """The first nrows*4096 bytes of 1-D uint8 `data` as an int64 [nrows, 512] view, or None if misaligned."""
    if data.data_ptr() % 8:
        return None
    return data[: nrows * ROW_BYTES].view(nrows, ROW_BYTES).view(torch.int64)


# ---------------------------------------------------------------------------------------------------------
# The kernels in PyTorch (int64 arithmetic, two's-complement wrap-around); one function, eager or compiled

_C1_S64 = _signed(_MIX_C1)
_C2_S64 = _signed(_MIX_C2)
_LOW31 = (1 << (64 - _MIX_SHIFT)) - 1  # (x >> 33) & _LOW31 is the logical shift of a signed int64


def _torch_mix_(x: torch.Tensor) -> torch.Tensor:
    """`mix` of int64 words, in place (cache-sized temporaries in eager mode; torch.compile fuses it)."""
    shifted = torch.empty_like(x)
    for factor in (_C1_S64, _C2_S64, None):
        torch.bitwise_right_shift(x, _MIX_SHIFT, out=shifted)
        shifted &= _LOW31  # logical shift: clear the copies of the sign bit
        x ^= shifted
        if factor is not None:
            x *= factor
    return x


def _keyed(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    x = torch.bitwise_xor(words, colkeys)
    x ^= rowkeys[:, None]
    return x


def _torch_row_sums(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    """Per-row sums of mix(w ^ T[c] ^ rk[r]) for int64 words [N, W]: the kernel, eager or compiled."""
    return _torch_mix_(_keyed(words, rowkeys, colkeys)).sum(dim=1)


def _torch_total(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    """The sum over all rows (the one-pass kernel for large tensors)."""
    return _torch_mix_(_keyed(words, rowkeys, colkeys)).sum()


def _torch_rowkeys(rows: torch.Tensor) -> torch.Tensor:
    """RK(r) in int64 torch ops (rows >= 0); same bits as `_np_rowkeys`."""
    x = (rows + _RK_ADD) & _M55
    x = (x * _RK_C1) & _M55
    x = x ^ (x >> _RK_S1)
    x = (x * _RK_C2) & _M55
    x = x ^ (x >> _RK_S2)
    return x << _COL_BITS


class _DeviceTables:
    """Per-device constants: column keys, a zero buffer for padding, and row keys 0..n-1 (grown on demand)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.colkeys = torch.from_numpy(_T_U64.view(np.int64).copy()).to(device)
        self.zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
        self._rowkeys = torch.empty(0, dtype=torch.int64, device=device)

    def rowkeys(self, n: int) -> torch.Tensor:
        if n > self._rowkeys.numel():
            size = max(n, 2 * self._rowkeys.numel(), 1024)
            self._rowkeys = _torch_rowkeys(torch.arange(size, dtype=torch.int64, device=self.device))
        return self._rowkeys[:n]


_tables: dict[torch.device, _DeviceTables] = {}
_tables_lock = threading.Lock()


def _device_tables(device: torch.device) -> _DeviceTables:
    tables = _tables.get(device)
    if tables is None:
        with _tables_lock:
            tables = _tables.get(device) or _DeviceTables(device)
            _tables[device] = tables
    return tables


class _CompiledKernels:
    """torch.compile'd kernels, built on first use; any failure disables them for that device type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[str, Callable[..., torch.Tensor]] = {}
        self._broken: dict[str, str] = {}
        self._checked: set[tuple[str, str, int]] = set()

    def _fn(self, kind: str) -> Callable[..., torch.Tensor]:
        fn = self._fns.get(kind)
        if fn is None:
            with self._lock:
                fn = self._fns.get(kind)
                if fn is None:
                    eager = _torch_total if kind == "total" else _torch_row_sums
                    fn = torch.compile(eager, dynamic=False, fullgraph=True)
                    self._fns[kind] = fn
        return fn

    def run(self, kind: str, words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor,
            forced: bool) -> torch.Tensor | None:
        device_type = words.device.type
        if device_type in self._broken:
            return None
        try:
            fn = self._fn(kind)
            mark_dynamic(words, 0)
            mark_dynamic(rowkeys, 0)
            out = fn(words, rowkeys, colkeys).reshape(-1)
            key = (device_type, kind, words.shape[1])
            if key not in self._checked:
                # One-time self-check per kernel, width and device type: the compiled kernel gives the eager bits.
                if not torch.equal(out, _eager_kernel(kind, words, rowkeys, colkeys)):
                    raise RuntimeError("the compiled kernel disagrees with the eager kernel")
                self._checked.add(key)
            return out
        except Exception as err:
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            self._broken[device_type] = reason
            if forced:
                raise FingerprintError(
                    f"{ENV_BACKEND}=compiled, but torch.compile failed on {device_type} ({reason})"
                ) from err
            warnings.warn(
                f"detrace: compiled fingerprint kernels are unavailable on {device_type} ({reason}); "
                "using the slower eager kernels (same digests)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None


_compiled = _CompiledKernels()


def _backend() -> str:
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise UsageError(f"{ENV_BACKEND}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def _eager_kernel(kind: str, words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    """The kernel in eager PyTorch, a block of rows at a time (cache-sized temporaries on CPU)."""
    block = max(1, (_EAGER_BLOCK_WORDS if words.device.type == "cpu" else 1 << 24) // max(words.shape[1], 1))
    sums = [_torch_row_sums(words[i : i + block], rowkeys[i : i + block], colkeys)
            for i in range(0, words.shape[0], block)]
    rows = torch.cat(sums) if len(sums) != 1 else sums[0]
    return rows.sum().reshape(1) if kind == "total" else rows


class _AutoPolicy:
    """When `auto` starts using compiled kernels: once the eager work done in this process (or one call)
    outweighs the one-time start-up cost of compiling (seconds). One-shot uses on small data never pay it."""

    def __init__(self) -> None:
        self.eager_words = 0

    def wants_compiled(self, words: int) -> bool:
        if words < COMPILE_MIN_WORDS:
            self.eager_words += words
            return False
        if self.eager_words + words >= AUTO_COMPILE_WORDS:
            return True
        self.eager_words += words
        return False


_auto = _AutoPolicy()


def _kernel(kind: str, words: torch.Tensor, rowkeys: torch.Tensor, backend: str) -> torch.Tensor:
    """Per-row sums (kind "rows", shape [N]) or the total (kind "total", shape [1]) as int64 on the device."""
    colkeys = _device_tables(words.device).colkeys[: words.shape[1]]
    if words.device.type == "cpu" and (backend == "native" or (backend == "auto" and cpu_kernel.usable)):
        # On the CPU `auto` never pauses for torch.compile: the native kernel from the first call
        if not cpu_kernel.usable:
            raise FingerprintError(f"{ENV_BACKEND}=native, but {cpu_kernel.failed}")
        host = cpu_kernel.row_sums(words.numpy().view(np.uint64), rowkeys.numpy().view(np.uint64),
                                   colkeys.numpy().view(np.uint64), torch.get_num_threads())
        rows = torch.from_numpy(host.view(np.int64))
        return rows.sum().reshape(1) if kind == "total" else rows
    if words.shape[0] >= 2 and (backend == "compiled" or (backend == "auto" and _auto.wants_compiled(words.numel()))):
        out = _compiled.run(kind, words, rowkeys, colkeys, forced=backend == "compiled")
        if out is not None:
            return out
    return _eager_kernel(kind, words, rowkeys, colkeys)


# ---------------------------------------------------------------------------------------------------------
# Planning a batch: pieces of bytes -> row batches -> partial sums on the device, owners on the host


def _narrow_width(nbytes: int) -> int:
    return next(w for w in _NARROW_WIDTHS if nbytes <= 8 * w)


class _DevicePlan:
    """Everything one device contributes to a batch: partial sums (device) and their owners (host)."""

    def __init__(self, device: torch.device, backend: str) -> None:
        self.device = device
        self.backend = backend
        self.tables = _device_tables(device)
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
            self._emit(_np_row_sums(host, rowkeys).view(np.int64), owners)
            return
        rk = torch.from_numpy(rowkeys.view(np.int64))
        if self.device.type == "cuda":  # pinned + non_blocking: the copy is queued, the host never waits
            rk = rk.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            rk = rk.to(self.device)
        self._emit(_kernel("rows", words, rk, self.backend), owners)

    def add_bytes(self, data: torch.Tensor, owner: int, consts: list[int]) -> None:
        """Add S(data) to digest `owner` (data: 1-D uint8 on this device, the whole logical tensor)."""
        n = data.numel()
        if n == 0:
            return
        if n <= ROW_BYTES:
            width = _narrow_width(n)
            self.narrow[width].append((data, owner))
            consts[owner] = (consts[owner] + _Z0[width]) & _M64
            return
        if n < BODY_MIN_BYTES:
            self._pack(data, 0, owner)
            return
        body_rows = n // ROW_BYTES
        body = _as_rows(data, body_rows)
        if body is None:  # storage offset not 8-byte aligned: hash an aligned copy
            body = _as_rows(data[: body_rows * ROW_BYTES].clone(), body_rows)
        assert body is not None
        self._emit(_kernel("total", body, self.tables.rowkeys(body_rows), self.backend),
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
                self._rows(words, np.full(m, _RK0, dtype=np.uint64), owner_arr)
                for o in owners:
                    consts[o] = (consts[o] + _Z0[width]) & _M64
                continue
            rows = -(-nbytes // ROW_BYTES)
            padded = torch.nn.functional.pad(block, (0, rows * ROW_BYTES - nbytes))
            words = padded.reshape(m * rows, ROW_BYTES).view(torch.int64)
            rowkeys = np.tile(_np_rowkeys(np.arange(rows)), m)
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
            self._rows(words, np.full(len(items), _RK0, dtype=np.uint64), owners)
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
        self._rows(words, _np_rowkeys(row_numbers), np.repeat(owners, counts))
        self.packed = []
        self.packed_bytes = 0


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
                 consts: list[int], result: list[Fingerprint] | None = None) -> None:
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
                np.add.at(acc, np.concatenate(plan.owners), device_sums[device].view(np.uint64))
            if plan.host_owners:
                np.add.at(acc, np.concatenate(plan.host_owners), np.concatenate(plan.host_results).view(np.uint64))
        acc += np.array(self._headers, dtype=np.uint64)
        acc += np.array(self._consts, dtype=np.uint64)
        digests = [int(v) for v in acc]
        self._result = [_resolve(node, digests) for node in self._nodes]
        self._plans = {}


def _combine(dtype: str, shape: tuple[int, ...], parts: tuple[tuple[str, Fingerprint], ...]) -> int:
    """The digest of a component object: BLAKE2b of its dtype, shape and each named component digest."""
    text = "|".join(f"{name}={fp.hex}" for name, fp in parts)
    header = f"{SCHEME}:components|{dtype}|{','.join(map(str, shape))}|{text}"
    return int.from_bytes(hashlib.blake2b(header.encode(), digest_size=8).digest(), "little")


def _resolve(node: _Node, digests: list[int]) -> Fingerprint:
    if node.components:
        parts = tuple((name, _resolve(child, digests)) for name, child in node.components)
        return Fingerprint(_combine(node.dtype, node.shape, parts), node.dtype, node.shape, node.numel,
                           components=parts)
    chunks = None if node.chunk_slots is None else tuple(digests[s] for s in node.chunk_slots)
    return Fingerprint(digests[node.slot], node.dtype, node.shape, node.numel, chunks, node.chunk_dim)


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


# ---------------------------------------------------------------------------------------------------------
# Public entry points


def _check_chunks(chunks: int | None, dim: int) -> None:
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise UsageError(f"chunks must be a positive integer or None, not {chunks!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise UsageError(f"dim must be an integer, not {dim!r}")


def _chunk_dim(t: torch.Tensor, dim: int) -> int:
    """`dim` as a non-negative dimension of `t`, or UsageError."""
    if t.dim() == 0:
        raise UsageError("chunk-wise fingerprints need a tensor with at least one dimension")
    if not -t.dim() <= dim < t.dim():
        raise UsageError(f"dim {dim} is out of range for a tensor with {t.dim()} dimensions")
    return dim % t.dim()


def _chunk_sizes(length: int, chunks: int) -> list[int]:
    """Near-equal chunk sizes, as torch.tensor_split: the first (length % n) chunks are one longer."""
    n = min(chunks, length)
    if n == 0:
        return []
    q, r = divmod(length, n)
    return [q + 1] * r + [q] * (n - r)


def _chunk_groups(t: torch.Tensor, dim: int, sizes: list[int]) -> Iterator[tuple[torch.Tensor, int, int]]:
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
        yield _bytes_of(part.reshape(m, outer * size * inner).contiguous()), size, m
        start += m * size
        i += m


def _part_chunks(part: Any, chunks: int | None, dim: int) -> int | None:
    """Chunk-wise mode reaches the components that have dimension `dim` (a per-tensor scale has none)."""
    ok = isinstance(part, torch.Tensor) and -part.dim() <= dim < part.dim()
    return chunks if ok else None


def _component_meta(obj: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype, logical shape) of a component object: its `dtype` (a torch dtype or a format name) and `shape`."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, torch.dtype):
        name = _dtype_name(dtype)
    else:
        name = dtype if isinstance(dtype, str) else type(obj).__name__
    return name, tuple(int(s) for s in getattr(obj, "shape", ()))


class _Planner:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.plans: dict[torch.device, _DevicePlan] = {}
        self.headers: list[int] = []
        self.consts: list[int] = []

    def _slot(self, header: int) -> int:
        self.headers.append(header)
        self.consts.append(0)
        return len(self.headers) - 1

    def _plan(self, device: torch.device) -> _DevicePlan:
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = _DevicePlan(device, self.backend)
        return plan

    def add(self, obj: Any, chunks: int | None, dim: int) -> _Node:
        parts = _components_of(obj)
        if parts is not None:
            return self._add_components(obj, parts, chunks, dim)
        t = _plain(obj)
        dtype = _dtype_name(t.dtype)
        shape = tuple(t.shape)
        node = _Node(dtype, shape, t.numel(), slot=self._slot(_header(dtype, shape)))
        plan = self._plan(t.device)
        plan.add_bytes(_logical_bytes(t), node.slot, self.consts)
        if chunks is not None:
            dim = _chunk_dim(t, dim)
            sizes = _chunk_sizes(t.shape[dim], chunks)
            slots: list[int] = []
            groups = []
            for block, size, m in _chunk_groups(t, dim, sizes):
                chunk_shape = (*shape[:dim], size, *shape[dim + 1 :])
                owners = [self._slot(_header(dtype, chunk_shape)) for _ in range(m)]
                slots.extend(owners)
                groups.append((block, owners))
            plan.add_chunks(groups, self.consts)
            node.chunk_slots, node.chunk_dim = tuple(slots), dim
        return node

    def _add_components(self, obj: Any, parts: Mapping[str, Any], chunks: int | None, dim: int) -> _Node:
        children = tuple((str(name), self.add(part, _part_chunks(part, chunks, dim), dim))
                         for name, part in parts.items())
        dtype, shape = _component_meta(obj)
        return _Node(dtype, shape, math.prod(shape), components=children)

    def stage(self, nodes: list[_Node]) -> StagedFingerprints:
        for plan in self.plans.values():
            plan.finish()
        return StagedFingerprints(nodes, self.plans, self.headers, self.consts)


@contextlib.contextmanager
def _quiet_modes() -> Iterator[None]:
    """Fingerprinting observes tensors: no autograd, and no active dispatch mode may see or fake our ops."""
    with torch.no_grad(), quiet_dispatch_modes():
        yield


def stage(tensors: Sequence[Any], *, chunks: int | None = None, dim: int = 0) -> StagedFingerprints:
    """Start fingerprinting `tensors` on their devices; read the results later with `.result()`/`collect`.

    `chunks` and `dim` apply to every tensor (see `fingerprint`).
    """
    _check_chunks(chunks, dim)
    backend = _backend()
    if backend == "reference":
        return StagedFingerprints([], {}, [], [], [reference_fingerprint(t, chunks=chunks, dim=dim) for t in tensors])
    planner = _Planner(backend)
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
    data = _logical_bytes(t).cpu().numpy()
    return (_np_bytes_sum(data) + _header(_dtype_name(t.dtype), tuple(t.shape))) & _M64


def reference_fingerprint(tensor: Any, *, chunks: int | None = None, dim: int = 0) -> Fingerprint:
    """Same result as `fingerprint`, computed by the slow, simple reference path (for tests and audits)."""
    _check_chunks(chunks, dim)
    with _quiet_modes():
        parts = _components_of(tensor)
        if parts is not None:
            children = tuple(
                (str(name), reference_fingerprint(part, chunks=_part_chunks(part, chunks, dim), dim=dim))
                for name, part in parts.items()
            )
            dtype, shape = _component_meta(tensor)
            return Fingerprint(_combine(dtype, shape, children), dtype, shape, math.prod(shape),
                               components=children)
        t = _plain(tensor)
        digest = _reference_digest(t)
        if chunks is None:
            return Fingerprint(digest, _dtype_name(t.dtype), tuple(t.shape), t.numel())
        dim = _chunk_dim(t, dim)
        pieces = torch.tensor_split(t, min(chunks, t.shape[dim]), dim=dim) if t.shape[dim] else ()
        return Fingerprint(digest, _dtype_name(t.dtype), tuple(t.shape), t.numel(),
                           tuple(_reference_digest(p) for p in pieces), dim)
