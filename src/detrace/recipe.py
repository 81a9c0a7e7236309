"""The determinism recipe: one call that sets and validates every switch that decides determinism.

`deterministic(seed)` turns on deterministic kernels, turns off autotuners and reduced-precision math,
pins the collective algorithm, seeds every global RNG, and fails closed: a setting the user made that
contradicts the recipe is an error naming it, and an environment variable that can no longer take effect
(because CUDA or NCCL already started) is an error in strict mode and a warning otherwise.

`judge()` says where each switch stands (ok, pending, conflict, too late); `detrace.audit` adds the risks the
recipe cannot remove and `detrace doctor` prints both. `settings()` is the flat snapshot stored in every
trace header; it is cheap and never initialises CUDA.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from detrace.errors import DeterminismError, UsageError

UNSET = "<unset>"

Status = Literal["ok", "pending", "conflict", "too-late", "risk"]


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One line of the audit."""

    name: str
    """The setting: a torch flag (`torch.backends.cudnn.benchmark`) or an environment variable."""
    value: str
    """Its current value (`<unset>` for an unset environment variable)."""
    status: Status
    """`ok` (as the recipe wants), `pending` (at its default; `deterministic()` sets it), `conflict`
    (someone set it against the recipe), `too-late` (it can no longer take effect in this process) or
    `risk` (not a switch; a condition under which runs may still differ)."""
    detail: str
    """What the setting prevents, or what is wrong and what to do."""

    @property
    def off(self) -> bool:
        """Whether this finding makes the environment non-deterministic (`detrace doctor` exits 1)."""
        return self.status in ("conflict", "too-late")


@dataclass(frozen=True, kw_only=True)
class DeterminismSettings:
    """What `deterministic()` established."""

    seed: int
    """The seed given to Python's `random`, NumPy and torch (CPU and every CUDA device)."""
    strict: bool
    """Whether nondeterministic ops raise (True) or only warn (False), and late settings raise or warn."""
    settings: Mapping[str, str] = field(default_factory=dict)
    """The snapshot of `settings()` right after the recipe was applied."""
    notices: tuple[str, ...] = ()
    """Warnings of non-strict mode: settings that came too late to take effect."""
    routed: tuple[str, ...] = ()
    """With `kernels="detrace"`: the torch ops routed to detrace.ops' kernels, as `op on device` strings."""


@dataclass(frozen=True, kw_only=True)
class _Switch:
    """One setting of the recipe and how to read, judge and apply it."""

    name: str
    prevents: str
    read: Callable[[], str]
    default: str
    accept: Callable[[bool], frozenset[str]]
    apply: Callable[[bool], None] | None = None
    deadline: Literal["cuda", "nccl"] | None = None
    recommended: str | None = None


def _env(name: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, UNSET)


def _env_switch(
    name: str, value: str, *, prevents: str, also: tuple[str, ...] = (), deadline: Literal["cuda", "nccl"] | None = None
) -> _Switch:
    """An environment variable the recipe sets to `value` (and also accepts at one of `also`)."""

    def apply(strict: bool) -> None:
        os.environ[name] = value

    return _Switch(
        name=name, prevents=prevents, read=_env(name), default=UNSET, accept=_always(value, *also), apply=apply,
        deadline=deadline, recommended=value,
    )


def _always(*values: str) -> Callable[[bool], frozenset[str]]:
    return lambda strict: frozenset(values)


def inductor_option(attribute: str, env: str) -> Callable[[], str]:
    """An Inductor option: from its config if Inductor is imported (importing it costs a second), else
    from the environment variable its config is initialised from."""

    def read() -> str:
        config = sys.modules.get("torch._inductor.config")
        if config is not None:
            for part in attribute.split("."):
                config = getattr(config, part)
            return str(bool(config))
        return str(os.environ.get(env) == "1")

    return read


def _inductor_deterministic(strict: bool) -> None:
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.deterministic = True  # type: ignore[attr-defined]  # an Inductor config module; mypy sees a ModuleType


def _deterministic_algorithms() -> str:
    if not torch.are_deterministic_algorithms_enabled():
        return "False"
    return "warn_only" if torch.is_deterministic_algorithms_warn_only_enabled() else "True"


def _set_fill_uninitialized_memory(strict: bool) -> None:
    # mypy, ignored below: torch.utils.deterministic's module class has this property; its stubs lack it
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]


def _set_cudnn_deterministic(strict: bool) -> None:
    torch.backends.cudnn.deterministic = True


def _set_cudnn_benchmark(strict: bool) -> None:
    torch.backends.cudnn.benchmark = False


def _set_cudnn_tf32(strict: bool) -> None:
    torch.backends.cudnn.allow_tf32 = False


def _set_matmul_tf32(strict: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


SWITCHES: tuple[_Switch, ...] = (
    # Prevents kernels whose result depends on thread/atomic scheduling (index_put_ with accumulate,
    # scatter_add on CUDA, ...): they get a deterministic implementation or raise (warn when not strict).
    _Switch(
        name="torch.use_deterministic_algorithms",
        prevents="kernels whose result depends on thread scheduling (atomics, unordered accumulation)",
        read=_deterministic_algorithms,
        default="False",
        accept=lambda strict: frozenset({"True"} if strict else {"True", "warn_only"}),
        apply=lambda strict: torch.use_deterministic_algorithms(True, warn_only=not strict),
    ),
    # Prevents uninitialised memory (torch.empty) from leaking run-dependent garbage into results.
    _Switch(
        name="torch.utils.deterministic.fill_uninitialized_memory",
        prevents="uninitialised memory (torch.empty) leaking run-dependent garbage into results",
        # mypy, ignored below: as above (a property of the module class)
        read=lambda: str(bool(torch.utils.deterministic.fill_uninitialized_memory)),  # type: ignore[attr-defined]
        default="True",
        accept=_always("True"),
        apply=_set_fill_uninitialized_memory,
    ),
    # Prevents cuDNN from choosing convolution algorithms that accumulate with atomics.
    _Switch(
        name="torch.backends.cudnn.deterministic",
        prevents="cuDNN convolution algorithms that accumulate with atomics",
        read=lambda: str(torch.backends.cudnn.deterministic),
        default="False",
        accept=_always("True"),
        apply=_set_cudnn_deterministic,
    ),
    # Prevents cuDNN's autotuner from picking, by timing, a different algorithm in each run.
    _Switch(
        name="torch.backends.cudnn.benchmark",
        prevents="cuDNN's autotuner picking, by timing, a different convolution algorithm in each run",
        read=lambda: str(torch.backends.cudnn.benchmark),
        default="False",
        accept=_always("False"),
        apply=_set_cudnn_benchmark,
    ),
    # Prevents TF32 convolutions, whose rounding differs from FP32 and between GPU generations.
    _Switch(
        name="torch.backends.cudnn.allow_tf32",
        prevents="TF32 convolutions, whose rounding differs from FP32 and between GPU generations",
        read=lambda: str(torch.backends.cudnn.allow_tf32),
        default="True",
        accept=_always("False"),
        apply=_set_cudnn_tf32,
    ),
    # Prevents TF32 matmuls, whose rounding differs from FP32 and between GPU generations.
    _Switch(
        name="torch.backends.cuda.matmul.allow_tf32",
        prevents="TF32 matmuls, whose rounding differs from FP32 and between GPU generations",
        read=lambda: str(torch.backends.cuda.matmul.allow_tf32),
        default="False",
        accept=_always("False"),
        apply=_set_matmul_tf32,
    ),
    # Prevents reduced-precision (TF32/bf16) internal float32 matmuls chosen via the precision knob.
    _Switch(
        name="torch.float32_matmul_precision",
        prevents="float32 matmuls computed internally in TF32 or bfloat16",
        read=torch.get_float32_matmul_precision,
        default="highest",
        accept=_always("highest"),
    ),
    # Prevents the override that forces TF32 in cuBLAS whatever the flags above say.
    _Switch(
        name="TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        prevents="the override that forces TF32 in cuBLAS whatever torch's flags say",
        read=_env("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
        default=UNSET,
        accept=_always(UNSET, "0"),
    ),
    # Prevents cuBLAS from splitting work over several workspaces per stream in a run-dependent way; cuBLAS
    # reads it when its first handle is created, i.e. it must be set before CUDA starts.
    _env_switch(
        "CUBLAS_WORKSPACE_CONFIG",
        ":4096:8",
        also=(":16:8",),
        prevents="cuBLAS splitting reductions over workspaces in a run-dependent way",
        deadline="cuda",
    ),
    # Prevents NCCL from switching, by message size or topology, between algorithms (or to in-network
    # NVLS/CollNet reduction) with different reduction orders; read when a communicator is created.
    _env_switch(
        "NCCL_ALGO",
        "Ring",
        also=("Tree",),
        prevents="NCCL switching between algorithms with different reduction orders",
        deadline="nccl",
    ),
    # Prevents Transformer Engine from using its nondeterministic (atomic) fused-attention backward kernels.
    _env_switch(
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
        "0",
        prevents="Transformer Engine's nondeterministic fused-attention backward kernels",
    ),
    # Prevents Inductor from benchmarking candidate kernels on the device and keeping the fastest.
    _Switch(
        name="torch._inductor.config.deterministic",
        prevents="Inductor choosing compiled kernels by on-device benchmarks",
        read=inductor_option("deterministic", "TORCHINDUCTOR_DETERMINISTIC"),
        default="False",
        accept=_always("True"),
        apply=_inductor_deterministic,
    ),
    # Prevents Inductor's max-autotune from picking GEMM/pointwise configurations by timing.
    _Switch(
        name="torch._inductor.config.max_autotune",
        prevents="Inductor's max-autotune picking kernel configurations by timing",
        read=inductor_option("max_autotune", "TORCHINDUCTOR_MAX_AUTOTUNE"),
        default="False",
        accept=_always("False"),
    ),
    # Prevents Inductor's coordinate-descent tuner from picking kernel parameters by timing.
    _Switch(
        name="torch._inductor.config.coordinate_descent_tuning",
        prevents="Inductor's coordinate-descent tuner picking kernel parameters by timing",
        read=inductor_option("coordinate_descent_tuning", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"),
        default="False",
        accept=_always("False"),
    ),
)

# Values this module set itself: re-running the recipe (say non-strict, then strict) is not a conflict.
_applied: dict[str, str] = {}
_seeded: dict[str, str] = {}


KERNELS = ("torch", "detrace")


def deterministic(seed: int, *, strict: bool = True, kernels: str = "torch") -> DeterminismSettings:
    """Set and validate every switch that decides determinism, and seed every RNG.

    Nothing is changed unless every switch can be applied: a conflicting setting raises DeterminismError
    naming it; an environment variable that CUDA or NCCL has already read raises in strict mode and warns
    otherwise. In strict mode an op without a deterministic implementation raises when it runs; otherwise
    it warns.

    `kernels="detrace"` also routes the index-accumulation ops (`index_put` with accumulate, `index_add`,
    `scatter_add`) to detrace.ops' deterministic kernels on the devices where those beat torch's own
    deterministic implementation (`detrace.ops.routing.ROUTES`); torch's switch stays on for every other op.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise UsageError(f"the seed must be an integer from 0 to 2**32-1, not {seed!r}")
    if kernels not in KERNELS:
        raise UsageError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    findings = judge(strict, applying=True)
    conflicts = [finding for finding in findings if finding.status == "conflict"]
    if conflicts:
        names = ", ".join(f"{finding.name}={finding.value}" for finding in conflicts)
        raise DeterminismError(f"conflicting setting {names}: {conflicts[0].detail}")
    late = [finding for finding in findings if finding.status == "too-late"]
    if late and strict:
        raise DeterminismError(late[0].detail)
    notices = tuple(finding.detail for finding in late)
    for notice in notices:
        warnings.warn(notice, RuntimeWarning, stacklevel=2)

    for switch in SWITCHES:
        if switch.apply is not None and switch.read() not in switch.accept(strict):
            switch.apply(strict)
            _applied[switch.name] = switch.read()

    random.seed(seed)  # Python's global RNG (random.shuffle, random.random in user code)
    np.random.seed(seed)  # NumPy's global RandomState (augmentation code that uses np.random)
    torch.manual_seed(seed)  # torch's CPU generator and, lazily, every CUDA device's (no CUDA init here)
    routed: tuple[str, ...] = ()
    if kernels == "detrace":
        from detrace.ops import routing

        routed = tuple(routing.install())
    _seeded.update({"detrace.seed": str(seed), "detrace.strict": str(strict), "detrace.kernels": kernels})
    return DeterminismSettings(seed=seed, strict=strict, settings=settings(), notices=notices, routed=routed)


def applied_strict() -> bool:
    """The `strict` of the last `deterministic()` call in this process (True before any)."""
    return _seeded.get("detrace.strict", "True") == "True"


def settings() -> dict[str, str]:
    """A flat, JSON-able snapshot of every determinism-relevant setting in force; cheap, no CUDA init."""
    snapshot = {switch.name: switch.read() for switch in SWITCHES}
    snapshot.update(
        {
            "detrace.seed": _seeded.get("detrace.seed", UNSET),
            "detrace.strict": _seeded.get("detrace.strict", UNSET),
            "detrace.kernels": _seeded.get("detrace.kernels", UNSET),
            "torch.version": torch.__version__,
            "torch.num_threads": str(torch.get_num_threads()),
            "torch.num_interop_threads": str(torch.get_num_interop_threads()),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", UNSET),
            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", UNSET),
            "cuda.initialized": str(torch.cuda.is_initialized()),
        }
    )
    return snapshot


def judge(strict: bool, *, applying: bool = False) -> list[Finding]:
    """Findings of every switch; with `applying`, a switch the recipe would set past its deadline is late."""
    findings = []
    for switch in SWITCHES:
        value = switch.read()
        if value in switch.accept(strict):
            status: Status = "ok"
            detail = f"prevents {switch.prevents}"
        elif value == switch.default or value == _applied.get(switch.name):
            started = _started(switch.deadline)
            status = "too-late" if started else "pending"
            detail = (
                f"{switch.name} must be set before {started} starts, and it already has: set it in the "
                f"environment that launches the process ({_example(switch)}); it prevents {switch.prevents}"
                if started
                else f"detrace.deterministic() sets it; it prevents {switch.prevents}"
            )
            if status == "pending" and applying:
                status = "ok"
        else:
            status = "conflict"
            detail = f"the recipe needs {' or '.join(sorted(switch.accept(strict)))}; it prevents {switch.prevents}"
        findings.append(Finding(name=switch.name, value=value, status=status, detail=detail))
    return findings


def _started(deadline: str | None) -> str | None:
    """The name of the runtime that has already read a setting with this deadline, if it started."""
    if deadline == "cuda" and torch.cuda.is_initialized():
        return "CUDA"
    if deadline == "nccl" and _nccl_started():
        return "NCCL"
    return None


def _nccl_started() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def _example(switch: _Switch) -> str:
    return f"{switch.name}={switch.recommended}"
