"""The kernels that compute a scheme's per-row sums on a tensor's device, and which scheme and kernel run.

Four implementations compute the same bits of each scheme, and the tests compare them:

- ``reference``: NumPy ``uint64`` arithmetic on a host copy, written to read like the definition
  (`detrace.digest.scheme`).
- ``eager``: the same arithmetic as PyTorch ``int64`` operations (two's-complement wrap-around) on the
  tensor's own device.
- ``compiled``: that eager function under ``torch.compile`` (one fused Inductor kernel on CPU, Triton on
  CUDA), compiled once per row width with a dynamic number of rows, cached on disk by Inductor.
- ``native``: on the CPU, the same loop in C, compiled when detrace is installed (`detrace.digest.native`).

For ``detrace-fp2`` on CUDA, ``auto`` and ``compiled`` run a Triton kernel (`detrace.digest._triton`) instead of
torch.compile: nothing to compile per shape beyond Triton's own cache. ``DETRACE_FINGERPRINT_SCHEME=fp1|fp2``
picks the scheme of new fingerprints (fp1 by default).

``DETRACE_FINGERPRINT_BACKEND=reference|eager|compiled|native|auto`` picks one. The default, ``auto``, hashes
small CPU batches in NumPy and larger ones with the native kernel from the first call, so no step pauses for
torch.compile on the CPU. Where the native kernel was not built, and on other devices, it hashes with eager kernels
until this process has hashed enough (256 MiB) to earn back the one-time compile cost; from then on large
batches use the compiled kernels (eager again if compilation fails, with a warning).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch

from detrace._compat import mark_dynamic
from detrace.digest.native import _Kernel
from detrace.digest.native import kernel as cpu_kernel
from detrace.digest.native import kernel2 as cpu_kernel2
from detrace.digest.scheme import (
    COL_BITS,
    M32,
    M55,
    MIX_C1,
    MIX_C2,
    MIX_SHIFT,
    MIXA,
    MIXB,
    RK_ADD,
    RK_C1,
    RK_C2,
    RK_S1,
    RK_S2,
    ROW_BYTES,
    SCHEME,
    SCHEME2,
    T_U64,
    TA_U32,
    TB_U32,
    Mix,
    np_rowkeys2,
    np_total,
    signed,
)
from detrace.errors import FingerprintError, UsageError

BACKENDS = ("auto", "reference", "eager", "compiled", "native")
ENV_BACKEND = "DETRACE_FINGERPRINT_BACKEND"
ENV_SCHEME = "DETRACE_FINGERPRINT_SCHEME"
SCHEME_NAMES = {"fp1": SCHEME, "fp2": SCHEME2, SCHEME: SCHEME, SCHEME2: SCHEME2}

# Work smaller than this (in 64-bit words) is not worth a compiled kernel; on CPU it runs in NumPy.
COMPILE_MIN_WORDS = 1 << 15
# `auto` compiles once this much work (words, 256 MiB) has been or would be hashed by the eager kernels.
AUTO_COMPILE_WORDS = 1 << 25
# Rows per step of the eager kernel on CPU (in words: 1 MiB of int64, cache-sized temporaries).
_EAGER_BLOCK_WORDS = 1 << 17


# ---------------------------------------------------------------------------------------------------------
# The kernels in PyTorch (int64 arithmetic, two's-complement wrap-around); one function, eager or compiled

_C1_S64 = signed(MIX_C1)
_C2_S64 = signed(MIX_C2)
_LOW31 = (1 << (64 - MIX_SHIFT)) - 1  # (x >> 33) & _LOW31 is the logical shift of a signed int64


def _torch_mix_(x: torch.Tensor) -> torch.Tensor:
    """`mix` of int64 words, in place (cache-sized temporaries in eager mode; torch.compile fuses it)."""
    shifted = torch.empty_like(x)
    for factor in (_C1_S64, _C2_S64, None):
        torch.bitwise_right_shift(x, MIX_SHIFT, out=shifted)
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
    """RK(r) in int64 torch ops (rows >= 0); same bits as `np_rowkeys`."""
    x = (rows + RK_ADD) & M55
    x = (x * RK_C1) & M55
    x = x ^ (x >> RK_S1)
    x = (x * RK_C2) & M55
    x = x ^ (x >> RK_S2)
    return x << COL_BITS


# ---------------------------------------------------------------------------------------------------------
# detrace-fp2 in PyTorch: 32-bit lanes held in int64 (products wrap mod 2**64, masked to their low 32 bits)


def _torch_mix32(x: torch.Tensor, mix: Mix) -> torch.Tensor:
    first, steps = mix
    x = x ^ (x >> first)
    for factor, shift in steps:
        x = (x * factor) & M32
        x = x ^ (x >> shift)
    return x


def _torch_lanes(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row (SA, SB) of int64 words [N, W] read as 2W 32-bit words, not yet reduced mod 2**32."""
    w = words.view(torch.int32).to(torch.int64) & M32
    sa = _torch_mix32(w ^ colkeys[0] ^ (rowkeys & M32)[:, None], MIXA).sum(dim=1)
    sb = _torch_mix32(w ^ colkeys[1] ^ ((rowkeys >> 32) & M32)[:, None], MIXB).sum(dim=1)
    return sa, sb


def _pack(sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return (sa & M32) | ((sb & M32) << 32)


def _torch_row_sums2(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    return _pack(*_torch_lanes(words, rowkeys, colkeys))


def _torch_total2(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    sa, sb = _torch_lanes(words, rowkeys, colkeys)
    return _pack(sa.sum(), sb.sum()).reshape(1)


def lane_total(rows: torch.Tensor) -> torch.Tensor:
    """The fp2 sum of packed per-row lane sums (int64 [N]) as int64 [1]."""
    return _pack((rows & M32).sum(), ((rows >> 32) & M32).sum()).reshape(1)


_TORCH_KERNELS = {(SCHEME, "rows"): _torch_row_sums, (SCHEME, "total"): _torch_total,
                  (SCHEME2, "rows"): _torch_row_sums2, (SCHEME2, "total"): _torch_total2}


class _DeviceTables:
    """Per-device constants: column keys, a zero buffer for padding, and row keys 0..n-1 (grown on demand)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.colkeys = torch.from_numpy(T_U64.view(np.int64).copy()).to(device)
        # fp2: [2, 1024] int64 (TA, TB) for the torch kernels, and the 2048 uint32 the C and Triton kernels read
        self.colkeys2 = torch.from_numpy(np.stack([TA_U32, TB_U32]).astype(np.int64)).to(device)
        self.colkeys2_u32 = torch.from_numpy(np.concatenate([TA_U32, TB_U32]).view(np.int32)).to(device)
        self.zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
        self._rowkeys = torch.empty(0, dtype=torch.int64, device=device)
        self._rowkeys2 = torch.empty(0, dtype=torch.int64, device=device)
        self._host_rowkeys: dict[str, np.ndarray] = {}  # CPU: NumPy views of the row keys, per scheme
        self._host_colkeys: dict[str, np.ndarray] = {}

    def rowkeys(self, n: int, scheme: str = SCHEME) -> torch.Tensor:
        """Row keys of rows 0..n-1 of `scheme` on the device."""
        if scheme == SCHEME2:
            if n > self._rowkeys2.numel():
                size = max(n, 2 * self._rowkeys2.numel(), 1024)
                self._rowkeys2 = torch.from_numpy(np_rowkeys2(np.arange(size)).view(np.int64)).to(self.device)
            return self._rowkeys2[:n]
        if n > self._rowkeys.numel():
            size = max(n, 2 * self._rowkeys.numel(), 1024)
            self._rowkeys = _torch_rowkeys(torch.arange(size, dtype=torch.int64, device=self.device))
        return self._rowkeys[:n]

    def host_colkeys(self, scheme: str) -> np.ndarray:
        """The column keys the native kernel of `scheme` reads, as NumPy, on a CPU device: fp1's 512 uint64, fp2's
        TA then TB (2048 uint32)."""
        host = self._host_colkeys.get(scheme)
        if host is None:
            fp2 = scheme == SCHEME2
            host = self._host_colkeys[scheme] = (self.colkeys2_u32.numpy().view(np.uint32) if fp2
                                                 else self.colkeys.numpy().view(np.uint64))
        return host

    def host_rowkeys(self, n: int, scheme: str) -> np.ndarray:
        """Row keys of rows 0..n-1 of `scheme` as uint64 NumPy, on a CPU device: a view, a few microseconds less per
        call than a tensor's."""
        host = self._host_rowkeys.get(scheme)
        if host is None or host.size < n:  # from the slice rowkeys returns: n keys whatever other threads grow
            host = self._host_rowkeys[scheme] = self.rowkeys(n, scheme).numpy().view(np.uint64)
        return host[:n]


_CPU = torch.device("cpu")
_tables: dict[torch.device, _DeviceTables] = {}
_tables_lock = threading.Lock()


def device_tables(device: torch.device) -> _DeviceTables:
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

    def _fn(self, scheme: str, kind: str) -> Callable[..., torch.Tensor]:
        fn = self._fns.get(scheme + kind)
        if fn is None:
            with self._lock:
                fn = self._fns.get(scheme + kind)
                if fn is None:
                    fn = torch.compile(_TORCH_KERNELS[scheme, kind], dynamic=False, fullgraph=True)
                    self._fns[scheme + kind] = fn
        return fn

    def run(self, scheme: str, kind: str, words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor,
            forced: bool) -> torch.Tensor | None:
        device_type = words.device.type
        if device_type in self._broken:
            return None
        try:
            fn = self._fn(scheme, kind)
            mark_dynamic(words, 0)
            mark_dynamic(rowkeys, 0)
            out = fn(words, rowkeys, colkeys).reshape(-1)
            key = (device_type, scheme + kind, words.shape[1])
            if key not in self._checked:
                # One-time self-check per kernel, width and device type: the compiled kernel gives the eager bits.
                if not torch.equal(out, _eager_kernel(scheme, kind, words, rowkeys, colkeys)):
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


def _eager_kernel(scheme: str, kind: str, words: torch.Tensor, rowkeys: torch.Tensor,
                  colkeys: torch.Tensor) -> torch.Tensor:
    """The kernel in eager PyTorch, a block of rows at a time (cache-sized temporaries on CPU)."""
    block = max(1, (_EAGER_BLOCK_WORDS if words.device.type == "cpu" else 1 << 24) // max(words.shape[1], 1))
    row_sums = _TORCH_KERNELS[scheme, "rows"]
    sums = [row_sums(words[i : i + block], rowkeys[i : i + block], colkeys) for i in range(0, words.shape[0], block)]
    rows = torch.cat(sums) if len(sums) != 1 else sums[0]
    if kind == "rows":
        return rows
    return rows.sum().reshape(1) if scheme == SCHEME else lane_total(rows)


# ---------------------------------------------------------------------------------------------------------
# Which kernel runs


def selected_scheme() -> str:
    """The scheme that DETRACE_FINGERPRINT_SCHEME names (detrace-fp1 when unset), or UsageError."""
    value = os.environ.get(ENV_SCHEME, "").strip().lower() or "fp1"
    if value not in SCHEME_NAMES:
        raise UsageError(f"{ENV_SCHEME}={value!r} is not one of fp1, fp2")
    return SCHEME_NAMES[value]


def selected_backend() -> str:
    """The backend that DETRACE_FINGERPRINT_BACKEND names (`auto` when unset), or UsageError."""
    value = os.environ.get(ENV_BACKEND)
    if value is None:  # the common case, read on every fingerprint
        return "auto"
    value = value.strip().lower() or "auto"
    if value not in BACKENDS:
        raise UsageError(f"{ENV_BACKEND}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


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


@functools.cache
def _triton_fp2() -> Callable[..., torch.Tensor] | None:
    """fp2's Triton kernel, or None where Triton is not installed (then the torch kernels run, same bits)."""
    try:
        from detrace.digest._triton import fp2_row_sums
    except ImportError:
        return None
    return fp2_row_sums


def native_kernel(scheme: str) -> _Kernel:
    """The native CPU kernel of `scheme` (built or not: its `usable`)."""
    return cpu_kernel2 if scheme == SCHEME2 else cpu_kernel


def runs_native(backend: str, scheme: str) -> bool:
    """Whether `backend` hashes CPU tensors with the native kernel of `scheme` (FingerprintError when it must and
    the kernel was not built)."""
    native = native_kernel(scheme)
    if backend == "native" and not native.usable:
        raise FingerprintError(f"{ENV_BACKEND}=native, but {native.failed}")
    return backend == "native" or (backend == "auto" and native.usable)


def native_rows(rows: np.ndarray, rowkeys: np.ndarray, scheme: str, threads: int | None = None) -> np.ndarray:
    """Per-row sums (uint64 [N]) by the native kernel of `scheme` of host rows [N, ...] (C-contiguous bytes of
    whole words: any dtype, any alignment) keyed by rowkeys (uint64 [N]), split over `threads` threads (torch's
    thread count when None)."""
    tables = device_tables(_CPU)
    if scheme == SCHEME2:
        words, colkeys = rows.view(np.uint32), tables.host_colkeys(scheme)
    else:
        words = rows.view(np.uint64)
        colkeys = tables.colkeys[: words.shape[1]].numpy().view(np.uint64)
    return native_kernel(scheme).row_sums(words, rowkeys, colkeys,
                                          torch.get_num_threads() if threads is None else threads)


def native_total(data: np.ndarray, rowkeys: np.ndarray, scheme: str, threads: int | None = None) -> int:
    """The sum (`scheme.add`) of the native kernel's row sums of bytes `data` (1-D uint8, any alignment) cut into
    4096-byte rows keyed by rowkeys (uint64, one per row): the whole rows hashed where they lie, the last partial
    row zero-padded as the definition pads it, in one C call per thread (`threads`: torch's thread count when
    None)."""
    return native_kernel(scheme).total(data, rowkeys, device_tables(_CPU).host_colkeys(scheme),
                                       torch.get_num_threads() if threads is None else threads)


def kernel(kind: str, words: torch.Tensor, rowkeys: torch.Tensor, backend: str, scheme: str = SCHEME) -> torch.Tensor:
    """Per-row sums (kind "rows", shape [N]) or the total (kind "total", shape [1]) as int64 on the device."""
    tables = device_tables(words.device)
    fp2 = scheme == SCHEME2
    colkeys = tables.colkeys2[:, : 2 * words.shape[1]] if fp2 else tables.colkeys[: words.shape[1]]
    if words.device.type == "cpu" and runs_native(backend, scheme):
        # On the CPU `auto` never pauses for torch.compile: the native kernel from the first call
        host = native_rows(words.numpy(), rowkeys.numpy().view(np.uint64), scheme)
        if kind == "total":  # in NumPy: a few microseconds less per call than torch ops on a small vector
            host = np.array([np_total(host, scheme)], dtype=np.uint64)
        return torch.from_numpy(host.view(np.int64))
    triton_kernel = _triton_fp2() if fp2 and words.device.type == "cuda" and backend in ("auto", "compiled") else None
    if triton_kernel is not None:
        rows = triton_kernel(words, rowkeys, tables.colkeys2_u32)
        return rows if kind == "rows" else lane_total(rows)
    if words.shape[0] >= 2 and (backend == "compiled" or (backend == "auto" and _auto.wants_compiled(words.numel()))):
        out = _compiled.run(scheme, kind, words, rowkeys, colkeys, forced=backend == "compiled")
        if out is not None:
            return out
    return _eager_kernel(scheme, kind, words, rowkeys, colkeys)
