"""Arming what the environment asks for in a training process: the replica guard (DETRACE_GUARD) and an injected
fault (DETRACE_FAULT, a test tool).

They are armed in the traced program only: at the tracer's start under `detrace run` (the start-up hook) and in
`detrace.trace`, and when a `TrainState` is made (a script that follows the resume contract without `detrace run`).
Never at `import detrace`: every detrace command imports the package too, and a malformed value in the
environment must not break `detrace --help`.

The rule for every detrace variable read in the training process (docs/tracing.md): a malformed value is one
sentence on stderr when the process starts, the feature it configures stays off, and the program runs on.
"""

from __future__ import annotations

import importlib
import os
import sys

from detrace.errors import DetraceError

_FEATURES = (("DETRACE_GUARD", "detrace.defects.guard", "the replica guard"),
             ("DETRACE_FAULT", "detrace.defects.faults", "the injected fault"))


_refused: set[tuple[str, str]] = set()
"""(variable, value) pairs already refused in this process: the sentence is said once, though every arming point
(the tracer's start, each TrainState) tries again (it was printed twice under `detrace run`)."""


def arm_from_env() -> None:
    """Install the guard and the fault the environment asks for (each once per process; nothing when unset)."""
    for variable, module, feature in _FEATURES:
        value = os.environ.get(variable)
        if not value or (variable, value) in _refused:
            continue
        try:
            importlib.import_module(module).arm_from_env()
        except DetraceError as err:
            _refused.add((variable, value))
            print(f"detrace: {err}; {feature} is off in process {os.getpid()}", file=sys.stderr)
