"""The determinism recipe: one call that sets and validates every switch that decides determinism.

`deterministic(seed)` turns on deterministic kernels, turns off autotuners and reduced-precision math,
pins the collective algorithm, seeds every global RNG, and fails closed: a setting the user made that
contradicts the recipe is an error naming it, and an environment variable that can no longer take effect
(because CUDA or NCCL already started) is an error in strict mode and a warning otherwise.

`judge()` says where each switch stands (ok, pending, conflict, too late); `detrace.recipe.doctor` adds the risks the
recipe cannot remove and `detrace doctor` prints both. `settings()` is the flat snapshot stored in every
trace header; it is cheap and never initialises CUDA. The switches themselves, one record each with what it
prevents, are the table of `detrace.recipe.switches`.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from detrace.errors import DeterminismError, UsageError
from detrace.recipe.switches import SWITCHES, UNSET, Switch, inductor_option

__all__ = ["SWITCHES", "UNSET", "DeterminismSettings", "Finding", "applied_strict", "deterministic", "inductor_option",
           "judge", "settings"]

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


def _example(switch: Switch) -> str:
    return f"{switch.name}={switch.recommended}"
