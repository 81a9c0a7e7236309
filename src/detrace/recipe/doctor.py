"""The audit behind `detrace doctor`: where every switch of the recipe stands in this process
(`detrace.recipe.judge`), which of detrace's own kernels are in use, and the risks the recipe cannot remove
(Inductor's autotuning and CUDA graphs, the thread count, the hash seed)."""

from __future__ import annotations

import os
import sys

import torch

from detrace import _compat
from detrace.recipe import UNSET, Finding, applied_strict, inductor_option, judge


def audit() -> list[Finding]:
    """Every switch of the recipe as it stands in this process, then the risks the recipe cannot remove."""
    return [_torch_release(), *judge(applied_strict()), *_kernel_routes(), *_fingerprint_kernels(), *_risks()]


def _torch_release() -> Finding:
    """Whether detrace's private-API shims (detrace._compat) were checked against the installed torch."""
    if _compat.release_checked():
        return Finding(name="torch", value=torch.__version__, status="ok",
                       detail=f"a release detrace is checked on ({', '.join(_compat.CHECKED_TORCH)})")
    return Finding(name="torch", value=torch.__version__, status="risk",
                   detail=f"detrace is checked on torch {', '.join(_compat.CHECKED_TORCH)} only: its private-API "
                          "shims may not hold here (a missing one is reported by name when used)")


def _fingerprint_kernels() -> list[Finding]:
    """Which kernel fingerprints CPU tensors in each scheme: the native one built at install (its vector path on
    this CPU, its compiler), or the slower fallbacks."""
    from detrace.digest.native import kernel, kernel2

    findings = []
    for scheme, native in (("fp1", kernel), ("fp2", kernel2)):
        name = f"detrace fingerprint kernel {scheme} (CPU)"
        if native.usable:
            findings.append(Finding(name=name, value="native", status="ok",
                                    detail=f"the C kernel compiled at install, {native.build}: full speed from "
                                           "the first call"))
        else:
            findings.append(Finding(name=name, value="NumPy/eager", status="ok",
                                    detail=f"the same bits, several times slower: {native.failed}; reinstall "
                                           "detrace where a C compiler is present"))
    return findings


def _kernel_routes() -> list[Finding]:
    """One line per op that `kernels="detrace"` routes (ok once routed in this process), and one per device
    where nothing is routed and why."""
    from detrace.ops import routing

    routed = routing.routed()
    findings = []
    for device, ops in routing.ROUTES.items():
        if not ops:
            findings.append(Finding(name=f"detrace.ops on {device}", value="torch", status="ok",
                                    detail=f"nothing is routed on {device}: {routing.WHY_NOT[device]}"))
        for op in ops:
            here = f"{op} on {device}" in routed
            detail = (
                "routed to detrace.ops' sort-once segmented reduction (no atomics, fixed order)"
                if here
                else "torch's kernel (deterministic under the recipe); an option, not a gap: "
                "detrace.deterministic(seed, kernels='detrace') routes it to detrace.ops' sort-once segmented "
                "reduction, meant to beat torch's deterministic sort path (bench/gpu_check.py measures)"
            )
            # either way is deterministic under the recipe: the route is a speed choice, so both are `ok`
            findings.append(Finding(name=f"detrace.ops aten::{op} on {device}", value="routed" if here else "torch",
                                    status="ok", detail=detail))
    return findings


# Inductor settings that are not switches of the recipe but decide what compiled code runs: (attribute of
# torch._inductor.config, the environment variable it is initialised from, what it does when on).
_INDUCTOR_SETTINGS = (
    ("max_autotune_gemm", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
     "matrix multiplications are chosen among candidate kernels by timing them, so two runs may run different "
     "kernels"),
    ("max_autotune_pointwise", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
     "pointwise and reduction kernel configurations are chosen by timing, so a reduction's order may differ "
     "between runs"),
    ("triton.cudagraphs", "TORCHINDUCTOR_CUDAGRAPHS",
     "compiled regions replay as CUDA graphs on static buffers (mode='reduce-overhead'): deterministic kernels "
     "stay deterministic, but the tracer sees a replay as one call and no kernel inside it"),
)


def _inductor_findings() -> list[Finding]:
    """Inductor's autotuning and CUDA-graph settings (ok when off, a risk when on), and the rule that its code
    follows the deterministic-algorithms flag of the moment it is generated."""
    findings = []
    for attribute, env, effect in _INDUCTOR_SETTINGS:
        value = inductor_option(attribute, env)()
        findings.append(Finding(name=f"torch._inductor.config.{attribute}", value=value,
                                status="risk" if value == "True" else "ok",
                                detail=f"when on, {effect}" if value != "True" else effect))
    if _compat.dynamo_imported() and not torch.are_deterministic_algorithms_enabled():
        findings.append(Finding(
            name="torch.compile", value="in use", status="risk",
            detail=("Inductor reads torch.use_deterministic_algorithms when it generates code: regions compiled "
                    "while it is off keep atomic-add scatters (index_put, scatter_add, index_add backward) that "
                    "race between threads; turn it on before the first compiled call")))
    return findings


def _risks() -> list[Finding]:
    findings = _inductor_findings()
    threads = os.environ.get("OMP_NUM_THREADS", UNSET)
    if threads == UNSET:
        findings.append(
            Finding(
                name="OMP_NUM_THREADS",
                value=UNSET,
                status="risk",
                detail=(
                    f"torch uses {torch.get_num_threads()} thread{'s' * (torch.get_num_threads() != 1)} here, a "
                    "count it derived from this machine's cores: CPU reductions split their work by thread count, "
                    "so runs on machines with other core counts may differ; set OMP_NUM_THREADS (or "
                    "torch.set_num_threads) explicitly"
                ),
            )
        )
    if sys.flags.hash_randomization and os.environ.get("PYTHONHASHSEED", "random") == "random":
        findings.append(
            Finding(
                name="PYTHONHASHSEED",
                value=os.environ.get("PYTHONHASHSEED", UNSET),
                status="risk",
                detail=(
                    "string hashes are randomised per process, so code that iterates over a set of strings "
                    "sees another order in each run; set PYTHONHASHSEED=0 where the process is launched"
                ),
            )
        )
    return findings
