"""Route torch's index-accumulation ops to `detrace.ops.index` through torch.library.

`install(devices)` registers this package's deterministic kernels as the aten kernels of `_index_put_impl_`
(what `index_put_`, `x[i] = v`, `x[i] += v` and the backward of `x[i]` call), `index_add` and `scatter_add`,
for the given device types. Autograd is untouched (the kernels sit below it), and every other op keeps torch's
own deterministic switch. `detrace.deterministic(seed, kernels="detrace")` installs the routes of `ROUTES`:
only where they beat torch's deterministic implementation.

- CUDA: torch's deterministic `index_put`/`index_add` sort and then serialise repeated indices (reported
  10-100x slower than atomics when indices repeat a lot); the Triton segmented reduction keeps one program per
  destination row and block of columns, without atomics.
- CPU: torch's deterministic accumulation is one serial loop, faster than a sort on 2 cores (bench/kernels.py
  measures both), so nothing is routed there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from detrace.ops import index

# device type -> aten ops routed there by `detrace.deterministic(kernels="detrace")`
ROUTES: dict[str, tuple[str, ...]] = {
    "cuda": ("_index_put_impl_", "index_add", "scatter_add"),
    "cpu": (),
}

# device type -> why nothing is routed there (for `detrace doctor`)
WHY_NOT: dict[str, str] = {
    "cpu": "torch's deterministic CPU accumulation (one serial loop) is faster on few cores than a sort",
}

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _index_put_impl_(self: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor,
                     accumulate: bool = False, unsafe: bool = False) -> torch.Tensor:
    return index.index_put_(self, indices, values, accumulate)


def _index_add(self: torch.Tensor, dim: int, idx: torch.Tensor, source: torch.Tensor, *,
               alpha: Any = 1) -> torch.Tensor:
    return index.index_add(self, dim, idx, source, alpha=alpha)


def _index_add_(self: torch.Tensor, dim: int, idx: torch.Tensor, source: torch.Tensor, *,
                alpha: Any = 1) -> torch.Tensor:
    return index.index_add_(self, dim, idx, source, alpha=alpha)


def _index_add_out(self: torch.Tensor, dim: int, idx: torch.Tensor, source: torch.Tensor, *, alpha: Any = 1,
                   out: torch.Tensor) -> torch.Tensor:
    out.resize_(self.shape).copy_(self)
    return index.index_add_(out, dim, idx, source, alpha=alpha)


def _scatter_add(self: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return index.scatter_add(self, dim, idx, src)


def _scatter_add_(self: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return index.scatter_add_(self, dim, idx, src)


def _scatter_add_out(self: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor, *,
                     out: torch.Tensor) -> torch.Tensor:
    out.resize_(self.shape).copy_(self)
    return index.scatter_add_(out, dim, idx, src)


# op name -> (overload, kernel) pairs registered for it
_KERNELS: dict[str, tuple[tuple[str, Callable[..., torch.Tensor]], ...]] = {
    "_index_put_impl_": (("_index_put_impl_", _index_put_impl_),),
    "index_add": (("index_add", _index_add), ("index_add_", _index_add_), ("index_add.out", _index_add_out)),
    "scatter_add": (("scatter_add", _scatter_add), ("scatter_add_", _scatter_add_),
                    ("scatter_add.out", _scatter_add_out)),
}

_library: torch.library.Library | None = None
_routed: list[str] = []


def install(devices: Sequence[str] | None = None) -> list[str]:
    """Register the kernels of `ROUTES` (or of every op, for `devices` given explicitly); idempotent.
    Returns what is routed, as `op on device` strings."""
    global _library
    wanted = [(op, device) for device in (devices if devices is not None else ROUTES)
              for op in (ROUTES[device] if devices is None else _KERNELS)]
    if _library is not None:
        if [f"{op} on {device}" for op, device in wanted] == _routed:
            return list(_routed)
        uninstall()
    import warnings

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that an aten kernel is being overridden: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        for op, device in wanted:
            for overload, kernel in _KERNELS[op]:
                library.impl(overload, kernel, _DISPATCH_KEYS[device])
    _library = library
    _routed[:] = [f"{op} on {device}" for op, device in wanted]
    return list(_routed)


def uninstall() -> None:
    """Give the ops back to torch's own kernels."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
    _routed.clear()


def routed() -> list[str]:
    """What is routed now, as `op on device` strings (empty when nothing is)."""
    return list(_routed)
