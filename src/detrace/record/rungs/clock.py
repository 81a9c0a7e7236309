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

from detrace.record.opaque import Opaque
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

    def pre(optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if tracer.clock.checkpoint_depth:
            return None  # an optimizer step inside checkpoint I/O is not a training step (detrace.record.steps)
        if tracer.clock.source == "process" and not tracer.clock.stepped:
            tracer.restored(restored_step(optimizer), in_step=True)
        ran = _closure_first(tracer, args, kwargs)
        tracer.optimizer_begins(optimizer)
        return ran

    return register_optimizer_step_pre_hook(Opaque(pre)).remove


class _RanOnce:
    """A step's closure that already ran: its first call returns that result, any later one (LBFGS evaluates
    again) runs it."""

    def __init__(self, closure: Callable[[], Any], result: Any) -> None:
        self.closure = closure
        self.result: Any = result
        self.used = False

    def __call__(self) -> Any:
        if self.used:
            return self.closure()
        self.used, result, self.result = True, self.result, None
        return result


def _closure_first(tracer: Tracer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """For `optimizer.step(closure)`: run the closure now, as the step's work, and hand the optimizer its result;
    None when there is no closure.

    Why: Lightning passes each step's forward and backward to `optimizer.step` as a closure (so do LBFGS loops),
    which the optimizer runs after the step hooks. The rungs' hooks would record the previous step's gradients
    as this step's (and a resumed process, which has none, would differ from the continuous run there), and the
    step's forward would run in the optimizer phase. Run first, the closure is the step's forward and backward,
    and the hooks that follow see its gradients. (Step pre-hooks registered after tracing began run after the
    closure too.)"""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
    if not callable(closure):
        return None
    tracer.training_begins()  # the closure is the next step's work, as its forward would be
    with torch.enable_grad():  # as the optimizers run their closure
        ran = _RanOnce(closure, closure())
    if "closure" in kwargs:
        return args, {**kwargs, "closure": ran}
    return (args[0], ran, *args[2:]), kwargs


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
        if not tracer.clock.checkpoint_depth:
            tracer.optimizer_ends()

    return register_optimizer_step_post_hook(Opaque(post)).remove
