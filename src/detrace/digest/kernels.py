"""The kernels that compute the scheme's per-row sums on a tensor's device, and which of them runs.

Four implementations compute the same bits, and the tests compare them:

- ``reference``: NumPy ``uint64`` arithmetic on a host copy, written to read like the definition
  (`detrace.digest.scheme`).
- ``eager``: the same arithmetic as PyTorch ``int64`` operations (two's-complement wrap-around) on the
  tensor's own device.
- ``compiled``: that eager function under ``torch.compile`` (one fused Inductor kernel on CPU, Triton on
  CUDA), compiled once per row width with a dynamic number of rows, cached on disk by Inductor.
- ``native``: on the CPU, the same loop in C, compiled when detrace is installed (`detrace.digest.native`).

``DETRACE_FINGERPRINT_BACKEND=reference|eager|compiled|native|auto`` picks one. The default, ``auto``, hashes
small CPU batches in NumPy and larger ones with the native kernel from the first call, so no step pauses for
torch.compile on the CPU. Where the native kernel was not built, and on other devices, it hashes with eager kernels
until this process has hashed enough (256 MiB) to earn back the one-time compile cost; from then on large
batches use the compiled kernels (eager again if compilation fails, with a warning).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

import numpy as np
import torch

from detrace._compat import mark_dynamic
from detrace.digest.native import kernel as cpu_kernel
from detrace.digest.scheme import (
    COL_BITS,
    M55,
    MIX_C1,
    MIX_C2,
    MIX_SHIFT,
    RK_ADD,
    RK_C1,
    RK_C2,
    RK_S1,
    RK_S2,
    ROW_BYTES,
    T_U64,
    signed,
)
from detrace.errors import FingerprintError, UsageError

BACKENDS = ("auto", "reference", "eager", "compiled", "native")
ENV_BACKEND = "DETRACE_FINGERPRINT_BACKEND"

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


class _DeviceTables:
    """Per-device constants: column keys, a zero buffer for padding, and row keys 0..n-1 (grown on demand)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.colkeys = torch.from_numpy(T_U64.view(np.int64).copy()).to(device)
        self.zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
        self._rowkeys = torch.empty(0, dtype=torch.int64, device=device)

    def rowkeys(self, n: int) -> torch.Tensor:
        if n > self._rowkeys.numel():
            size = max(n, 2 * self._rowkeys.numel(), 1024)
            self._rowkeys = _torch_rowkeys(torch.arange(size, dtype=torch.int64, device=self.device))
        return self._rowkeys[:n]


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


def _eager_kernel(kind: str, words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    """The kernel in eager PyTorch, a block of rows at a time (cache-sized temporaries on CPU)."""
    block = max(1, (_EAGER_BLOCK_WORDS if words.device.type == "cpu" else 1 << 24) // max(words.shape[1], 1))
    sums = [_torch_row_sums(words[i : i + block], rowkeys[i : i + block], colkeys)
            for i in range(0, words.shape[0], block)]
    rows = torch.cat(sums) if len(sums) != 1 else sums[0]
    return rows.sum().reshape(1) if kind == "total" else rows


# ---------------------------------------------------------------------------------------------------------
# Which kernel runs


def selected_backend() -> str:
    """The backend that DETRACE_FINGERPRINT_BACKEND names (`auto` when unset), or UsageError."""
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
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


def kernel(kind: str, words: torch.Tensor, rowkeys: torch.Tensor, backend: str) -> torch.Tensor:
    """Per-row sums (kind "rows", shape [N]) or the total (kind "total", shape [1]) as int64 on the device."""
    colkeys = device_tables(words.device).colkeys[: words.shape[1]]
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
