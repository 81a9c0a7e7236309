"""Zero-edit start-up: a directory to put first on PYTHONPATH, holding a `sitecustomize` that arms the tracer.

`detrace run` prepends `DIRECTORY` to PYTHONPATH and sets `DETRACE_TRACE`; every Python process CMD starts
(torchrun's workers and mp.spawn's children included, since they inherit the environment) then imports the
sitecustomize in this directory at start-up. Without `DETRACE_TRACE` it only chains to the sitecustomize it
shadows. With it, it waits for the program's own `import torch` and arms the tracer right after: a process
that never imports torch is untouched, and torch is not imported earlier than the program would import it
(so settings such as OMP_NUM_THREADS that a program sets before importing torch still take effect).
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
"""The directory `detrace run` puts first on PYTHONPATH."""


def note_untraced(reason: str) -> None:
    """Tell the launcher that the tracer did not start in this process, and why: a note in the run directory
    (`tracefile.layout.untraced_path`), which `detrace run` folds into run.json so that its summary, and every
    command given the run, can say why nothing was recorded. Called by the start-up hook, which has printed the
    reason already; an OSError (the directory gone, a full disk) is the caller's to ignore."""
    import json
    import os

    from detrace.tracefile.layout import untraced_path

    # DETRACE_TRACE (record.config.ENV_VAR) read here as plain JSON: importing detrace.record may be what failed
    out = json.loads(os.environ["DETRACE_TRACE"])["out"]
    untraced_path(out, os.getpid()).write_text(json.dumps({"pid": os.getpid(), "reason": reason}))
