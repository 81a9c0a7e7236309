"""Which integration fits a command: read from the imports of the Python script it runs, so that a message
about a script that does not follow the resume contract names the one line that would make it follow it."""

from __future__ import annotations

import re
from pathlib import Path

_IMPORTS = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", re.MULTILINE)

ADVICE = {
    "lightning": "the Lightning callback, detrace.integrations.lightning.DetraceCallback",
    "transformers": "the Trainer callback, detrace.integrations.hf.DetraceCallback",
    "accelerate": "detrace.integrations.accelerate.register(accelerator)",
    "plain": "detrace.TrainState (resume_if_requested / end_of_step)",
}
"""What to use, by the framework the script trains with."""


def script_of(cmd: list[str]) -> Path | None:
    """The Python script that `cmd` runs (`python x.py`, `torchrun ... x.py`, `accelerate launch x.py`), if any."""
    return next((Path(arg) for arg in cmd if arg.endswith(".py") and Path(arg).is_file()), None)


def framework_of(cmd: list[str]) -> str:
    """A key of `ADVICE`: the framework whose trainer the script of `cmd` uses, by its imports."""
    script = script_of(cmd)
    if script is None:
        return "plain"
    try:
        source = script.read_text(errors="replace")
    except OSError:
        return "plain"
    imported = set(_IMPORTS.findall(source))
    if imported & {"lightning", "pytorch_lightning"}:
        return "lightning"
    # A loop that only builds its model with transformers is no Trainer script.
    if "transformers" in imported and re.search(r"\w*Trainer\b", source):
        return "transformers"
    if "accelerate" in imported:
        return "accelerate"
    return "plain"


def advice(cmd: list[str]) -> str:
    """`does it use ...?`: the integration that fits `cmd`."""
    return ADVICE[framework_of(cmd)]


def imports_detrace(cmd: list[str]) -> bool:
    """Whether the Python script that `cmd` runs imports detrace (TrainState, an integration): it follows the resume
    contract, and a run of it that wrote no checkpoint was too short to."""
    script = script_of(cmd)
    try:
        source = script.read_text(errors="replace") if script is not None else ""
    except OSError:
        return False
    return "detrace" in _IMPORTS.findall(source)
