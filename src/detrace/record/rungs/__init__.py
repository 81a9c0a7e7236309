"""The recording rungs. Each `install(tracer)` patches or hooks what it observes and returns its undo callables.

Order matters for the optimizer hooks (global hooks run in registration order): the step clock's pre-hook runs
first and its post-hook last, so the rungs' optimizer records carry the step they belong to.
"""

from __future__ import annotations

from collections.abc import Callable

from detrace.record import opaque
from detrace.record.rungs import (
    batch,
    checkpoints,
    clock,
    compiled,
    loader_samples,
    metrics,
    module,
    op,
    semantic,
    state_parts,
)
from detrace.record.session import Tracer
from detrace.tracefile.schema import rung_includes

Undo = Callable[[], None]


def install(tracer: Tracer) -> list[Undo]:
    """Install the step clock and every rung up to `tracer.config.rung`; returns the undo callables."""
    undo = [clock.install_pre(tracer), clock.install_restore(tracer), *metrics.install(tracer),
            *batch.install(tracer),  # at every rung: the model's forward begins a step (detrace.record.steps)
            *state_parts.install(tracer),  # at every rung, before the stop of checkpoints: check-resume's parts
            *checkpoints.install(tracer)]  # at every rung: the program's own checkpoint saves and loads
    rung = tracer.config.rung
    if rung_includes(rung, "semantic"):
        # (loader_samples: the indices of a plain DataLoader's batches, which the batch rung records there)
        undo += semantic.install(tracer) + compiled.install(tracer) + loader_samples.install(tracer)
    if rung_includes(rung, "module"):
        undo += module.install(tracer)
    if rung_includes(rung, "op"):
        undo += op.install(tracer)
    undo.append(clock.install_post(tracer))
    return undo + opaque.install()  # the hooks above, hidden from Dynamo (see detrace.record.opaque)
