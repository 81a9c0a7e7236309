"""The facts a trace header records about the process: library versions and determinism settings.

Shared by the launcher's run.json and each rank's header, so both say the same thing in the same words.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

from detrace.record.config import TraceConfig
from detrace.tracefile.schema import SCHEMA_VERSION


def versions() -> dict[str, Any]:
    """torch, Python, CUDA and NCCL versions (None where not built in)."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except (RuntimeError, AttributeError):
            nccl = None
    from detrace import __version__

    return {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
            "nccl": nccl, "detrace": __version__}


def determinism() -> dict[str, Any] | None:
    """The determinism settings in force, from `detrace.recipe.settings()` when the recipe module exists."""
    try:
        from detrace.recipe import settings
    except ImportError:
        return None
    return settings()


def base_header(config: TraceConfig, *, world_size: int | None) -> dict[str, Any]:
    """What run.json and every rank header share."""
    from detrace.digest.kernels import selected_scheme

    command = list(config.command) if config.command else list(sys.argv)
    return {"schema": SCHEMA_VERSION, "command": command, "world_size": world_size, "rung": config.rung,
            "windows": config.windows(), "ranks": config.rank_window.spec, "versions": versions(),
            "determinism": determinism(), "fingerprint": selected_scheme()}
