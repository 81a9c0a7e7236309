"""The step clock: global optimizer hooks, so any loop with an optimizer has steps without code changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace.tracing.session import Tracer


def install_pre(tracer: Tracer) -> Callable[[], None]:
    """Registered before every rung's hooks: the optimizer phase starts."""

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracer.optimizer_begins(optimizer)

    return register_optimizer_step_pre_hook(pre).remove


def install_post(tracer: Tracer) -> Callable[[], None]:
    """Registered after every rung's hooks: the step ends once they have recorded."""

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracer.optimizer_ends()

    return register_optimizer_step_post_hook(post).remove
