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
    """Install the step clock and every rung up to `tracer.config.rung`; returns the undo callables. A rung that
    refuses to install (a bad variable it reads: a UsageError) leaves nothing installed: what the rungs before it
    replaced (torch.autograd.backward among them) is put back before the error goes on, so that the program the
    start-up hook lets run on after the refusal runs untouched."""
    undo: list[Undo] = []
    try:
        undo += [clock.install_pre(tracer), clock.install_restore(tracer)]
        undo += metrics.install(tracer)
        undo += batch.install(tracer)  # at every rung: the model's forward begins a step (detrace.record.steps)
        undo += state_parts.install(tracer)  # at every rung, before the stop of checkpoints: check-resume's parts
        undo += checkpoints.install(tracer)  # at every rung: the program's own checkpoint saves and loads
        rung = tracer.config.rung
        if rung_includes(rung, "semantic"):
            # (loader_samples: the indices of a plain DataLoader's batches, which the batch rung records there)
            undo += semantic.install(tracer)
            undo += compiled.install(tracer)
            undo += loader_samples.install(tracer)
        if rung_includes(rung, "module"):
            undo += module.install(tracer)
        if rung_includes(rung, "op"):
            undo += op.install(tracer)
        undo.append(clock.install_post(tracer))
        undo += opaque.install()  # the hooks above, hidden from Dynamo (see detrace.record.opaque)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return undo
