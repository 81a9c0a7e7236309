"""The resume contract's environment for a run made in this process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def contract_environment(env: Mapping[str, str]) -> Iterator[None]:
    """The process environment with no DETRACE_* variable but those of `env`, for one in-process run (TrainState
    reads the contract there, as a fresh process would); the environment as it was afterwards."""
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.startswith("DETRACE_")]:
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
