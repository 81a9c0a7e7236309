"""Rung 1, semantic: collectives and point-to-point, DDP/FSDP2 gradient reductions, recompute, the optimizer.

One module per thing recorded, each with its `install(tracer)`:
- `collectives`: `torch.distributed` collectives and p2p, sync and async, recorded at completion;
- `functional`: functional collectives (`torch.ops._c10d_functional`: DTensor, expert parallelism, compiled code);
- `ddp`: DistributedDataParallel's bucket all-reduces, which run in C++, through a recording comm hook;
- `recompute`: `torch.utils.checkpoint.checkpoint`'s forward and recomputed outputs;
- `optimizer`: grads before each optimizer step, parameters and states after it.
`common` holds what they share: group names and the re-entry guard, so that a recorded call made inside another
(a helper that calls a collective, DDP's own all-reduce) is recorded once, at the outermost call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from detrace.record.rungs.semantic import optimizer, recompute
from detrace.record.session import Tracer

Undo = Callable[[], None]


def install(tracer: Tracer) -> list[Undo]:
    """Install every semantic recorder (the distributed ones where torch.distributed is available)."""
    if not dist.is_available():
        return recompute.install(tracer) + optimizer.install(tracer)
    from detrace.record.rungs.semantic import collectives, ddp, functional

    return (collectives.install(tracer) + functional.install(tracer) + ddp.install(tracer)
            + recompute.install(tracer) + optimizer.install(tracer))
