"""The kernel rung: re-execute one captured op call in isolation and test the op itself for nondeterminism.

The op rung names the first op whose inputs matched and whose output differed between two runs. That alone does
not say whether the op is nondeterministic or merely sensitive to something around it (a data race in a custom
kernel, memory reuse, a different algorithm chosen by a heuristic). The kernel rung answers it: the op's captured
inputs (`detrace.tracefile.save_capture`) are fed to the same op overload many times under each *arm* of
(thread count) x (deterministic algorithms off/on). Every repeat starts from fresh copies of the captured inputs,
so an in-place op never sees its own previous result. An arm is deterministic when every repeat gives the same
bits; the *base* arm reproduces the traced run's settings, and a switch is reported in `fixed_by` when applying it
to the base arm makes the op deterministic.

A compiled kernel (captured at the op rung inside a `torch.compile`d region, meta `kernel` and `code`: see
`detrace.record.rungs.compiled`) is replayed from the output code Inductor wrote, on the memory its buffers
addressed. Its parallel code is generated for the traced run's thread count and its choice of atomic adds is
made when Inductor generates it, so its arms are 1 thread and the run's count, with the run's deterministic
setting; the compile-time switches that would remove the race are given as `advice`, not tried.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrace._compat import op_schema
from detrace._numbers import parse_count
from detrace.analyze.replay_result import (
    ADVICE_COMPILED,
    ADVICE_EAGER,
    FIX_DETERMINISTIC,
    FIX_ONE_THREAD,
    REPLAY_SCHEMA,
    ArmResult,
    ReplayConfig,
    ReplayResult,
)
from detrace.errors import TraceError, UntrustedCode, UsageError
from detrace.tracefile.capture import CODE_HASH, Capture, load_capture, resolve_op  # not the lazy names: typed
from detrace.tracefile.integrity import file_sha256
from detrace.tracefile.layout import CAPTURE_DIR, capture_paths

# ATen ops whose Inductor CPU/Triton lowerings accumulate with atomic adds (in the order threads get there).
_ATOMIC_OPS = frozenset({"aten.index_put", "aten.index_put_", "aten._unsafe_index_put", "aten.scatter_add",
                         "aten.scatter_add_", "aten.scatter_reduce", "aten.index_add", "aten.index_add_",
                         "aten.embedding_dense_backward"})

# Float formats without a sign bit (E8M0 scales): their bit patterns are ordered like unsigned integers.
_UNSIGNED_FLOATS = (torch.float8_e8m0fnu,)

__all__ = ["ADVICE_COMPILED", "ADVICE_EAGER", "FIX_DETERMINISTIC", "FIX_ONE_THREAD", "REPLAY_SCHEMA", "ArmResult",
           "ReplayConfig", "ReplayResult", "find_capture", "list_captures", "replay", "replay_file"]


@contextlib.contextmanager
def _setting(threads: int, deterministic: bool) -> Iterator[None]:
    """Apply one arm's global settings and restore the caller's afterwards, whatever happens."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


def _fresh(value: Any, device: torch.device) -> Any:
    """A deep copy of the captured arguments with new tensor storage, so in-place ops start from scratch."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, list):
        return [_fresh(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v, device) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _written_args(op: Any, args: list[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors the op's schema says it writes (`Tensor(a!)`): the result of ops that return nothing."""
    written: list[torch.Tensor] = []
    for i, arg in enumerate(op_schema(op).arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += _tensors(value)
    return written


def _call(op: Any, capture: Capture, device: torch.device) -> list[torch.Tensor]:
    args, kwargs = _fresh(capture.args, device), _fresh(capture.kwargs, device)
    with torch.no_grad():
        result = op(*args, **kwargs)
    # A compiled kernel returns nothing and writes the buffers its meta names.
    writes = capture.meta.get("writes")
    outputs = [args[i] for i in writes] if writes is not None else _tensors(result) or _written_args(op, args, kwargs)
    return [t.detach().to("cpu") for t in outputs]


def _kernel(capture: Capture, *, trust_code: bool) -> Any:
    """The compiled kernel a capture names, loaded from the output code module Inductor wrote for it.

    Loading it executes that Python file, and a trace is data that people share: it runs only when the caller
    trusts the trace's code, and only while the file's SHA-256 is the one recorded when the capture was made.
    """
    name, code, recorded = capture.meta["kernel"], Path(str(capture.meta["code"])), capture.meta.get(CODE_HASH)
    if not trust_code:
        raise UntrustedCode(f"replaying compiled kernel {name} would execute the Python file {code} that the "
                            "capture names, and code named in a trace runs only with --trust-code "
                            "(trust_code=True), after its SHA-256 is checked against the capture's")
    if not code.is_file():
        raise TraceError(f"the compiled code of kernel {name} ({code}) is gone (Inductor's cache was cleared); "
                         "capture it again")
    if not isinstance(recorded, str):
        raise UntrustedCode(f"the capture of compiled kernel {name} records no SHA-256 of {code}, so detrace "
                            "cannot tell that the file is the one the run compiled and does not execute it")
    if file_sha256(code) != recorded:
        raise UntrustedCode(f"{code} is not the file the capture of compiled kernel {name} recorded (its SHA-256 "
                            "differs), so detrace does not execute it")
    spec = importlib.util.spec_from_file_location(f"detrace_replay_{code.stem}", code)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the trusted file is still code a trace names: whatever it raises is one sentence
        raise TraceError(f"the compiled code of kernel {name} ({code}) fails as it loads: {_failure(err)}") from None
    kernel = getattr(module, name, None)
    if not callable(kernel):
        raise TraceError(f"{code} holds no kernel {name}" + ("" if kernel is None else " (it names no function)"))
    return kernel


def _failure(err: BaseException) -> str:
    """An exception raised by code a capture names, as a clause: its type and its first line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as unsigned integers of its element width (complex: real and imaginary parts)."""
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    width = t.element_size()
    flat = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)
    return flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]).astype(np.uint64)


def _ulp(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(differing elements, largest distance): in ULPs for floats, in units for integers and booleans.

    Floats are sign-magnitude, so the distance between two values of one sign is the difference of their
    magnitude bits, and across signs it is their sum (+0 and -0 are 0 apart). Computed in uint64, which holds
    the sum of two magnitudes of any float up to 64 bits.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel()), 0
    ba, bb = _bits(a), _bits(b)
    differ = ba != bb
    count = int(differ.sum())
    if not count:
        return 0, 0
    if (a.is_floating_point() or a.is_complex()) and a.dtype not in _UNSIGNED_FLOATS:
        width = 8 * a.element_size() // (2 if a.is_complex() else 1)
        sign = np.uint64(1) << np.uint64(width - 1)
        ma, mb = ba[differ] & ~sign, bb[differ] & ~sign
        same = (ba[differ] & sign) == (bb[differ] & sign)
        dist = np.where(same, np.maximum(ma, mb) - np.minimum(ma, mb), ma + mb)
        return count, int(dist.max())
    if a.is_floating_point():
        # no sign bit: consecutive values are consecutive integers
        ma, mb = ba[differ], bb[differ]
        return count, int((np.maximum(ma, mb) - np.minimum(ma, mb)).max())
    va, vb = a.reshape(-1)[torch.from_numpy(differ)], b.reshape(-1)[torch.from_numpy(differ)]
    return count, int((va.to(torch.int64) - vb.to(torch.int64)).abs().max())


def _compare(first: list[torch.Tensor], other: list[torch.Tensor]) -> tuple[int, int]:
    if len(first) != len(other):
        return sum(t.numel() for t in first), 0
    count = ulp = 0
    for a, b in zip(first, other, strict=True):
        c, u = _ulp(a, b)
        count, ulp = count + c, max(ulp, u)
    return count, ulp


def _run_arm(op: Any, capture: Capture, device: torch.device, *, threads: int, deterministic: bool,
             config: ReplayConfig) -> ArmResult:
    first: list[torch.Tensor] | None = None
    patterns: set[bytes] = set()
    repeats = differing = max_ulp = 0
    error = None
    started = time.monotonic()
    with _setting(threads, deterministic):
        # Repeat for a minimum count *and* a minimum time: a race between threads only shows when the OS runs
        # them at the same moment, which on a loaded machine may take more than a handful of short calls.
        # A difference already seen settles the arm.
        while repeats < config.repeats or (len(patterns) == 1 and repeats < config.max_repeats
                                           and time.monotonic() - started < config.min_seconds):
            try:
                outputs = _call(op, capture, device)
            except RuntimeError as err:
                # Deterministic mode refuses ops without a deterministic implementation; report it, don't crash.
                error = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                break
            except Exception as err:  # the call itself is broken (a crafted kernel, arguments it cannot take)
                raise TraceError(f"{capture.op} cannot be replayed on its captured arguments: {_failure(err)}; "
                                 "no verdict is given") from None
            repeats += 1
            patterns.add(hashlib.blake2b(b"".join(_bits(t).tobytes() for t in outputs)).digest())
            if first is None:
                first = outputs
                continue
            count, ulp = _compare(first, outputs)
            differing, max_ulp = max(differing, count), max(max_ulp, ulp)
    matches = first is not None and bool(capture.outputs) and _compare(capture.outputs, first) == (0, 0)
    return ArmResult(threads=threads, deterministic=deterministic, repeats=repeats, distinct=len(patterns),
                     differing_elements=differing, max_ulp=max_ulp, matches_capture=matches, error=error)


def replay(capture: Capture, config: ReplayConfig | None = None, *, device: str | None = None,
           trust_code: bool = False) -> ReplayResult:
    """Run the kernel rung on one captured call (see the module docstring). A compiled kernel's code is executed
    only with `trust_code` (see `_kernel`)."""
    config = config or ReplayConfig()
    compiled = "kernel" in capture.meta
    op = _kernel(capture, trust_code=trust_code) if compiled else resolve_op(capture.op)
    target = torch.device(device or capture.meta.get("device") or "cpu")
    if target.type == "cuda" and not torch.cuda.is_available():
        target = torch.device("cpu")
    run_threads = int(capture.meta.get("threads") or torch.get_num_threads())
    run_det = bool(capture.meta.get("deterministic", False))
    if compiled:
        # Sized for the run's thread count at generation (per-thread accumulators): never more threads than that;
        # the deterministic flag acts when Inductor generates code, not when the kernel runs.
        threads = tuple(sorted({1, run_threads} | {t for t in config.threads or () if t <= run_threads}))
        settings = [(t, run_det) for t in threads]
    else:
        threads = config.threads or tuple(sorted({1, max(2, run_threads)}))
        settings = [(t, d) for t in threads for d in (False, True)]
    base_setting = (run_threads, run_det)
    if base_setting not in settings:
        settings.insert(0, base_setting)
    arms = {s: _run_arm(op, capture, target, threads=s[0], deterministic=s[1], config=config)
            for s in settings}
    base = arms[base_setting]
    fixed_by = []
    if base.nondeterministic:
        det_arm = arms.get((base_setting[0], True))
        if not run_det and det_arm is not None and det_arm.error is None and not det_arm.nondeterministic:
            fixed_by.append(FIX_DETERMINISTIC)
        one_arm = arms.get((1, run_det))
        if base_setting[0] > 1 and one_arm is not None and one_arm.error is None and not one_arm.nondeterministic:
            fixed_by.append(FIX_ONE_THREAD)
    shapes = [{"role": "in", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
              for t in _tensors([*capture.args, *capture.kwargs.values()])]
    shapes += [{"role": "out", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
               for t in capture.outputs]
    advice = []
    if compiled and base.nondeterministic:
        lowered = capture.meta.get("aten") or []
        ops = ", ".join([op for op in lowered if op in _ATOMIC_OPS] or lowered) or "its ops"
        module = capture.meta.get("module")
        advice = [ADVICE_COMPILED.format(ops=ops),
                  ADVICE_EAGER.format(module=f"module {module}" if module else "the model")]
    return ReplayResult(op=capture.op, meta=dict(capture.meta), shapes=shapes, base=base,
                        arms=list(arms.values()), fixed_by=fixed_by, advice=advice)


def find_capture(run_dir: str | Path, event: str, *, rank: int | None = None) -> Path:
    """The capture file of `event` in a run directory: a capture's seq number, or the path of a capture file."""
    path = Path(event)
    if path.suffix == ".safetensors" or path.is_file():
        if not path.is_file() and not path.is_absolute():
            path = Path(run_dir) / event
        if not path.is_file():
            raise TraceError(f"capture file {event} does not exist")
        return path
    if parse_count(event) is None:
        raise UsageError(f"--event must be a capture's seq number or a capture file path, not {event!r}")
    folder = Path(run_dir) / CAPTURE_DIR
    if not folder.is_dir():
        raise TraceError(f"{run_dir} holds no capture (run it with a capture selector first, see 'detrace locate')")
    wanted = parse_count(event)
    found = [path for r, seq, path in capture_paths(run_dir) if seq == wanted and (rank is None or r == rank)]
    if not found:
        held = sorted(p.name for p in folder.glob("*.safetensors"))
        raise TraceError(f"{folder} holds no capture of event {event}" + (f" (it holds {', '.join(held)})"
                                                                           if held else ""))
    if len(found) > 1:
        raise UsageError(f"event {event} was captured on several ranks ({', '.join(p.name for p in found)}); "
                         "pick one with --rank")
    return found[0]


def list_captures(run_dir: str | Path) -> list[Path]:
    """Every capture file of a run directory, by rank then seq."""
    return [path for *_, path in capture_paths(run_dir)]


def replay_file(path: str | Path, config: ReplayConfig | None = None, *, trust_code: bool = False) -> ReplayResult:
    """Load a capture file and replay it."""
    return replay(load_capture(path), config, trust_code=trust_code)
