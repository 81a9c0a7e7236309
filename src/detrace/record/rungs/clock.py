"""The step clock: global optimizer hooks, so any loop with an optimizer has steps without code changes.

It also detects a resume with no edit: an optimizer restored from a checkpoint carries its step count
(`state["step"]` of Adam, AdamW, RMSprop, Adagrad...; plain SGD keeps none). The count is read when the optimizer
loads a state dict (`Optimizer.load_state_dict`, which torch's DCP helpers, HF Trainer and Lightning call) and
again as this process's first optimizer step begins (for state restored some other way); the step clock then
continues from it, unless a source of higher precedence set it (see detrace.record.steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace.record.patch import replace
from detrace.record.session import Tracer


def restored_step(optimizer: Any) -> int:
    """The largest step count in an optimizer's state (0 when it has none): the optimizer steps it has taken."""
    steps = [0]
    for state in getattr(optimizer, "state", {}).values():
        count = state.get("step") if isinstance(state, dict) else None
        if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_meta:
            steps.append(int(count.item()))
        elif isinstance(count, int | float) and not isinstance(count, bool):
            steps.append(int(count))
    return max(steps)


def install_pre(tracer: Tracer) -> Callable[[], None]:
    """Registered before every rung's hooks: the optimizer phase starts."""

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if tracer.clock.source == "process" and not tracer.clock.stepped:
            tracer.restored(restored_step(optimizer), in_step=True)
        tracer.optimizer_begins(optimizer)

    return register_optimizer_step_pre_hook(pre).remove


def install_restore(tracer: Tracer) -> Callable[[], None]:
    """Read the step count of every optimizer state dict loaded while tracing."""
    original = torch.optim.Optimizer.load_state_dict

    def load_state_dict(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        original(optimizer, state_dict)
        tracer.restored(restored_step(optimizer))

    load_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    return replace(torch.optim.Optimizer, "load_state_dict", load_state_dict)


def install_post(tracer: Tracer) -> Callable[[], None]:
    """Registered after every rung's hooks: the step ends once they have recorded."""

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracer.optimizer_ends()

    return register_optimizer_step_post_hook(post).remove
