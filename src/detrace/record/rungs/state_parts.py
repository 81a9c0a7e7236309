"""At every rung: the training state as the optimizer step after K completed steps begins, part by part, for
`detrace check-resume` to compare a resumed run's restored state with the continuous run's at the same point.

Under DETRACE_STATE_AT=K[,K2...], as the optimizer step of global step K begins (K completed: in a resumed run, its
first update, before it changes anything) each optimizer's state is digested, part by part, into
`RUN/state-<pid>.jsonl` (detrace.tracefile.state_parts): the parameters it updates, its per-parameter state
(moments, step counts), its param groups' hyperparameters (learning rate, weight decay, ...), the LR schedulers
that drive it, and each of the process's RNG states (torch's CPU and CUDA generators, Python's `random`, NumPy's
global one). Each part is one digest of its exact bits (tensors by their fingerprint, floats by their hex form),
so two runs' parts are equal exactly when their bits are; the learning rate, weight decay and the schedulers' step
count are kept as values too, to be shown. The data position is the trace's own (the input batch of step K, in
phase "data").
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace.digest import fingerprint_many
from detrace.record.opaque import Opaque
from detrace.record.session import Tracer
from detrace.tracefile.layout import state_parts_path
from detrace.tracefile.state_parts import ENV_STATE_AT

Undo = Callable[[], None]
SHOWN_HYPERPARAMETERS = ("lr", "weight_decay")
"""The param groups' hyperparameters kept as values (to be shown next to a difference), besides their digest."""


def _steps() -> frozenset[int]:
    text = os.environ.get(ENV_STATE_AT, "")
    return frozenset(int(item) for item in text.split(",") if item.strip().isdigit())


class _Digest:
    """One digest of a nested value's exact bits: its structure and scalars as text, its tensors by fingerprint
    (all of them read back in one transfer)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def text(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            self.tensors.append(value.detach())
            return f"tensor:{len(self.tensors) - 1}"
        if isinstance(value, float):
            return value.hex()
        if isinstance(value, dict):  # in key order: a state dict restored through DCP lists its keys sorted
            items = sorted(value.items(), key=lambda item: (type(item[0]).__name__, str(item[0])))
            return [[self.text(key), self.text(item)] for key, item in items]
        if isinstance(value, list | tuple):
            return [self.text(item) for item in value]
        if isinstance(value, bool | int | str) or value is None:
            return value
        tobytes = getattr(value, "tobytes", None)  # a NumPy array (NumPy's RNG state)
        if callable(tobytes):
            return f"{type(value).__name__}:{getattr(value, 'dtype', '')}:{hashlib.sha256(tobytes()).hexdigest()}"
        return type(value).__qualname__  # a function (a LambdaLR's lambda): not state

    def of(self, *values: Any) -> str:
        structure = [self.text(value) for value in values]
        digests = [print_.hex for print_ in fingerprint_many(self.tensors)] if self.tensors else []
        self.tensors = []
        return hashlib.sha256(json.dumps([structure, digests]).encode()).hexdigest()[:16]


def _schedulers(optimizer: Any) -> list[Any]:
    """The LR schedulers that drive `optimizer` (directly, or through a wrapper such as accelerate's), in the
    order the garbage collector lists them: found once per stop point, so no constructor needs patching."""
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.lr_scheduler.LRScheduler):  # (type: never a proxy's __class__)
            driven = getattr(obj, "optimizer", None)
            if driven is optimizer or getattr(driven, "optimizer", None) is optimizer:
                found.append(obj)
    return found


def _rng_states() -> dict[str, Any]:
    """Each RNG state the process has: torch's CPU generator, the CUDA generators (once CUDA is initialized),
    Python's `random`, NumPy's global one (once NumPy is imported); None for one it does not have."""
    numpy = sys.modules.get("numpy")
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"torch RNG state": torch.get_rng_state(),
            "CUDA RNG states": torch.cuda.get_rng_state_all() if cuda else None,
            "Python RNG state": random.getstate(),
            "NumPy RNG state": numpy.random.get_state() if numpy is not None else None}


def parts_of(optimizer: Any) -> tuple[dict[str, str | None], dict[str, str]]:
    """The digest of each part of the state (None: the part is not there, such as a loop without a scheduler), and
    the values shown next to a difference."""
    digest = _Digest()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    schedulers = _schedulers(optimizer)
    state = [optimizer.state.get(p, {}) for p in params]
    parts: dict[str, str | None] = {
        "parameters": digest.of(params),
        "optimizer state": digest.of(state),
        "param groups": digest.of(hyper),
        "scheduler": digest.of([s.state_dict() for s in schedulers]) if schedulers else None,
        **{name: digest.of(state) if state is not None else None for name, state in _rng_states().items()},
    }
    shown = {"param groups": "; ".join(", ".join(f"{k.replace('_', ' ')} {group[k]!r}" for k in SHOWN_HYPERPARAMETERS
                                                 if k in group) for group in hyper)}
    if schedulers:
        shown["scheduler"] = ", ".join(f"{type(s).__name__} at its step {s.last_epoch}" for s in schedulers)
    return parts, shown


def install(tracer: Tracer) -> list[Undo]:
    steps = _steps()
    if not steps:
        return []
    done: dict[int, list[int]] = {}
    """Per step, the optimizers (by id) digested at it: each once, numbered in the order their steps begin."""

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        step = tracer.clock.step
        if tracer.clock.checkpoint_depth:
            return  # not a training step: torch initialising a fresh optimizer's state (detrace.record.steps)
        if step not in steps or (not tracer.enabled and tracer.rank is not None):
            return  # (a rank outside the window, or a closed trace)
        seen = done.setdefault(step, [])
        if id(optimizer) in seen:
            return
        seen.append(id(optimizer))
        with tracer.own(), torch.no_grad():
            parts, shown = parts_of(optimizer)
        rank = tracer.rank
        if rank is None:
            distributed = torch.distributed
            rank = distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0
        line = {"step": step, "rank": rank, "optimizer": len(seen) - 1, "parts": parts, "shown": shown}
        try:
            tracer.config.out.mkdir(parents=True, exist_ok=True)
            with open(state_parts_path(tracer.config.out, os.getpid()), "a") as stream:
                stream.write(json.dumps(line) + "\n")
        except OSError as err:  # the training goes on; check-resume says the part-by-part comparison is missing
            print(f"detrace: the state of process {os.getpid()} at step {step} cannot be written ({err})",
                  file=sys.stderr)

    return [register_optimizer_step_pre_hook(Opaque(pre, noted=tracer.could_not)).remove]
