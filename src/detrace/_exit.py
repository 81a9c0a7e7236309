"""Ending a distributed process whose run is over, without the gloo shutdown crash."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from detrace._compat import run_exit_handlers


def leave(code: int) -> NoReturn:
    """End a process whose run is over: run the exit handlers, flush, and exit without finalizing Python.

    Why: destroy_process_group does not stop gloo's worker threads while a module, a DeviceMesh or DTensor's
    sharding cache still holds the group. A worker that drops the last reference to a tensor after the
    interpreter began to finalize needs the GIL; Python ends that thread with pthread_exit, which unwinds
    through a noexcept destructor and aborts a run that succeeded ("terminate called without an active
    exception", SIGABRT). Exiting with os._exit after the exit handlers (a tracer's last write among them)
    leaves no finalization to race with.
    """
    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
