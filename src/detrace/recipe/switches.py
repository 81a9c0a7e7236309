"""The recipe's switches: every setting that decides determinism, what it prevents, and how to read, judge and
set it. `detrace.recipe` applies and judges them; the table is also the list `detrace doctor` prints and the
snapshot every trace header stores."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from detrace import _compat

UNSET = "<unset>"
"""The value of an environment variable that is not set."""


@dataclass(frozen=True, kw_only=True)
class Switch:
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
) -> Switch:
    """An environment variable the recipe sets to `value` (and also accepts at one of `also`)."""

    def apply(strict: bool) -> None:
        os.environ[name] = value

    return Switch(
        name=name, prevents=prevents, read=_env(name), default=UNSET, accept=_always(value, *also), apply=apply,
        deadline=deadline, recommended=value,
    )


def _always(*values: str) -> Callable[[bool], frozenset[str]]:
    return lambda strict: frozenset(values)


def inductor_option(attribute: str, env: str) -> Callable[[], str]:
    """An Inductor option: from its config if Inductor is imported (importing it costs a second), else
    from the environment variable its config is initialised from."""

    def read() -> str:
        config = _compat.inductor_config()
        if config is not None:
            for part in attribute.split("."):
                config = getattr(config, part)
            return str(bool(config))
        return str(os.environ.get(env) == "1")

    return read


def _inductor_deterministic(strict: bool) -> None:
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    config = _compat.inductor_config()
    if config is not None:
        config.deterministic = True


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


SWITCHES: tuple[Switch, ...] = (
    # Prevents kernels whose result depends on thread/atomic scheduling (index_put_ with accumulate,
    # scatter_add on CUDA, ...): they get a deterministic implementation or raise (warn when not strict).
    Switch(
        name="torch.use_deterministic_algorithms",
        prevents="kernels whose result depends on thread scheduling (atomics, unordered accumulation)",
        read=_deterministic_algorithms,
        default="False",
        accept=lambda strict: frozenset({"True"} if strict else {"True", "warn_only"}),
        apply=lambda strict: torch.use_deterministic_algorithms(True, warn_only=not strict),
    ),
    # Prevents uninitialised memory (torch.empty) from leaking run-dependent garbage into results.
    Switch(
        name="torch.utils.deterministic.fill_uninitialized_memory",
        prevents="uninitialised memory (torch.empty) leaking run-dependent garbage into results",
        # mypy, ignored below: as above (a property of the module class)
        read=lambda: str(bool(torch.utils.deterministic.fill_uninitialized_memory)),  # type: ignore[attr-defined]
        default="True",
        accept=_always("True"),
        apply=_set_fill_uninitialized_memory,
    ),
    # Prevents cuDNN from choosing convolution algorithms that accumulate with atomics.
    Switch(
        name="torch.backends.cudnn.deterministic",
        prevents="cuDNN convolution algorithms that accumulate with atomics",
        read=lambda: str(torch.backends.cudnn.deterministic),
        default="False",
        accept=_always("True"),
        apply=_set_cudnn_deterministic,
    ),
    # Prevents cuDNN's autotuner from picking, by timing, a different algorithm in each run.
    Switch(
        name="torch.backends.cudnn.benchmark",
        prevents="cuDNN's autotuner picking, by timing, a different convolution algorithm in each run",
        read=lambda: str(torch.backends.cudnn.benchmark),
        default="False",
        accept=_always("False"),
        apply=_set_cudnn_benchmark,
    ),
    # Prevents TF32 convolutions, whose rounding differs from FP32 and between GPU generations.
    Switch(
        name="torch.backends.cudnn.allow_tf32",
        prevents="TF32 convolutions, whose rounding differs from FP32 and between GPU generations",
        read=lambda: str(torch.backends.cudnn.allow_tf32),
        default="True",
        accept=_always("False"),
        apply=_set_cudnn_tf32,
    ),
    # Prevents TF32 matmuls, whose rounding differs from FP32 and between GPU generations.
    Switch(
        name="torch.backends.cuda.matmul.allow_tf32",
        prevents="TF32 matmuls, whose rounding differs from FP32 and between GPU generations",
        read=lambda: str(torch.backends.cuda.matmul.allow_tf32),
        default="False",
        accept=_always("False"),
        apply=_set_matmul_tf32,
    ),
    # Prevents reduced-precision (TF32/bf16) internal float32 matmuls chosen via the precision knob.
    Switch(
        name="torch.float32_matmul_precision",
        prevents="float32 matmuls computed internally in TF32 or bfloat16",
        read=torch.get_float32_matmul_precision,
        default="highest",
        accept=_always("highest"),
    ),
    # Prevents the override that forces TF32 in cuBLAS whatever the flags above say.
    Switch(
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
    Switch(
        name="torch._inductor.config.deterministic",
        prevents="Inductor choosing compiled kernels by on-device benchmarks",
        read=inductor_option("deterministic", "TORCHINDUCTOR_DETERMINISTIC"),
        default="False",
        accept=_always("True"),
        apply=_inductor_deterministic,
    ),
    # Prevents Inductor's max-autotune from picking GEMM/pointwise configurations by timing.
    Switch(
        name="torch._inductor.config.max_autotune",
        prevents="Inductor's max-autotune picking kernel configurations by timing",
        read=inductor_option("max_autotune", "TORCHINDUCTOR_MAX_AUTOTUNE"),
        default="False",
        accept=_always("False"),
    ),
    # Prevents Inductor's coordinate-descent tuner from picking kernel parameters by timing.
    Switch(
        name="torch._inductor.config.coordinate_descent_tuning",
        prevents="Inductor's coordinate-descent tuner picking kernel parameters by timing",
        read=inductor_option("coordinate_descent_tuning", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"),
        default="False",
        accept=_always("False"),
    ),
)
