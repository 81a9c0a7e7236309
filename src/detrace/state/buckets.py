"""One DDP gradient-bucket layout for a whole run, in every process, so that a resumed process reduces its
gradients exactly as the process that never stopped.

DDP without `find_unused_parameters` starts with one bucket holding every parameter and rebuilds its buckets
once, after the first backward, in the order that backward made the gradients ready. The layout decides how a
bucket's all-reduce splits and sums the flat buffer, so it decides the bits of the averaged gradients. A process
resumed at step K runs its step K+1 on the initial layout, where the continuous run is on the rebuilt one: the
run's parameters differ from that step on (tests/e2e/test_ddp_resume.py measures it at 4 ranks).

`pin_layout(model)` has the DDP that trains `model` rebuild its buckets in parameter order before its first
backward instead, in every process, resumed or not. `TrainState` calls it for its model, so a loop that builds
its TrainState before its first step resumes exactly. What it costs: the parameter-order layout reduces the
first parameters' bucket first, which backward makes ready last, so the all-reduces no longer overlap the
backward (docs/resume.md has the measurement).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from detrace._compat import pin_ddp_bucket_order

_PINNED: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def pinned(ddp: DistributedDataParallel) -> bool:
    """Whether `pin_layout` pinned this DDP module's layout (`detrace audit` then does not report its rebuild)."""
    return ddp in _PINNED


def _pin(ddp: DistributedDataParallel) -> None:
    pin_ddp_bucket_order(ddp)
    _PINNED.add(ddp)


def pin_layout(model: torch.nn.Module) -> None:
    """Pin the bucket layout of `model` if it is a DDP module, else of the DDP module that will wrap it (found at
    that module's first forward: `accelerator.unwrap_model(model)` or HF's model are the wrapped module)."""
    if isinstance(model, DistributedDataParallel):
        _pin(model)
        return
    if not (dist.is_available() and dist.is_initialized()):
        return  # no process group: no DDP module can wrap it
    target = weakref.ref(model)  # the hook must not keep a model alive

    def pin_the_wrapper(module: torch.nn.Module, args: Any) -> None:
        watched = target()
        if isinstance(module, DistributedDataParallel) and module.module is watched:
            _pin(module)
            handle.remove()
        elif module is watched or watched is None:  # it runs unwrapped (or is gone): no need to watch every call
            handle.remove()

    # A global hook: the wrapper is made after the TrainState, or elsewhere (accelerate, the HF Trainer).
    handle = torch.nn.modules.module.register_module_forward_pre_hook(pin_the_wrapper)
