"""Events one part of detrace announces and another, optional part listens to, so that neither imports the other.

The checkpoint side (detrace.state) must work without the tracer, and the tracer must not load the checkpoint code:
the announcer calls the listeners registered here, and a part that is never imported never registers.
"""

from __future__ import annotations

from collections.abc import Callable

step_restored: list[Callable[[int], None]] = []
"""Called with `n` when a training state was restored from a checkpoint taken after step n-1 (TrainState.load):
a recording tracer counts steps on from n (detrace.tracing registers `set_step` when imported)."""


def restored(step: int) -> None:
    """Announce that training resumes at `step`."""
    for listener in step_restored:
        listener(step)
