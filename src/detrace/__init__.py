"""detrace: bitwise-deterministic PyTorch training, proved, and the first divergent bit found when it is not.

The public API is small and imported lazily, so that `import detrace` (which the zero-edit launcher does in
every process it starts) costs next to nothing:

- `detrace.fingerprint(tensor, *, chunks=None)` and `detrace.fingerprint_many(tensors)`
- `detrace.trace(out, rung=..., steps=..., ranks=...)`, with `detrace.step()` and `detrace.metric(name, value)`
- `detrace.deterministic(seed)`
- `detrace.TrainState(...)`
- `detrace.diff(a, b)`
- `detrace.guard(every=N)`
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it. Module names differ from the public names on purpose: a submodule
# called `fingerprint` would shadow the function `detrace.fingerprint` once imported.
_API = {
    "fingerprint": "detrace.digest",
    "fingerprint_many": "detrace.digest",
    "Fingerprint": "detrace.digest",
    "trace": "detrace.record",
    "step": "detrace.record",
    "metric": "detrace.record",
    "deterministic": "detrace.recipe",
    "TrainState": "detrace.state",
    "diff": "detrace.analyze",
    "guard": "detrace.defects.guard",
}

__all__ = [*sorted(_API), "__version__"]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'detrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
