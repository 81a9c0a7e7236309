"""Whether a process seeds the global RNGs it draws from: torch's default generator, Python's `random` and
numpy's legacy global RNG.

Each starts from a seed the operating system gives (torch's default generator too: `torch.initial_seed()` differs
from process to process until `torch.manual_seed`), so a run that draws from one it never seeded gets other
numbers in every run: other initial weights, dropout masks, shuffles, augmentations. That is certain, and `detrace
check` sees it. What is watched, from the moment the probe is armed (before CMD's own code):
- torch: `manual_seed` and `set_rng_state` (patched to note a call: a resumed run restores the state), the
  initial seed (which a call through another path changes) and the generator's state, which a draw advances. The
  draw of the base seed a DataLoader makes for every iterator (`_BaseDataLoaderIter`, whether or not anything
  uses it) is set apart: it is judged with the loader (`judge.data_hazards`): it matters only when a worker draws;
- random and numpy: their `seed` and state-setting functions (patched to note a call) and their state.
Draws in DataLoader workers are not this process's: torch reseeds the three RNGs in each worker from the base seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from detrace.investigate.audit.records import Hazard
from detrace.record.patch import replace as patch

Undo = Callable[[], None]


def _numpy_state() -> bytes:
    _, keys, position, *_ = np.random.get_state(legacy=True)
    return np.asarray(keys).tobytes() + int(position).to_bytes(8, "little")


class SeedWatch:
    """What this process did with its global RNGs (see the module docstring)."""

    def __init__(self) -> None:
        self.torch_seed = torch.initial_seed()
        self.mark = torch.random.get_rng_state()
        """torch's generator state after the last draw set apart (a DataLoader iterator's base seed)."""
        self.torch_drew = False
        """A draw from torch's generator other than a DataLoader's base seed."""
        self.random_state, self.numpy_state = random.getstate(), _numpy_state()
        self.seeded: set[str] = set()
        """`torch`, `random` and `numpy` once their seed function was called."""
        self.undo: list[Undo] = []

    def install(self) -> list[Undo]:
        def noting(name: str, seed: Callable[..., Any]) -> Callable[..., Any]:
            def seeded(*args: Any, **kwargs: Any) -> Any:
                self.seeded.add(name)
                return seed(*args, **kwargs)
            return seeded

        # Restoring a saved state (a resumed run) sets the stream as much as a seed does.
        for owner, name, rng in ((random, "seed", "random"), (random, "setstate", "random"),
                                 (np.random, "seed", "numpy"), (np.random, "set_state", "numpy"),
                                 (torch, "manual_seed", "torch"), (torch.random, "manual_seed", "torch"),
                                 (torch, "set_rng_state", "torch"), (torch.random, "set_rng_state", "torch")):
            self.undo.append(patch(owner, name, noting(rng, getattr(owner, name))))
        loader_iter = torch.utils.data.DataLoader.__iter__

        def watched_iter(loader: Any) -> Any:
            self.catch_up()
            iterator = loader_iter(loader)
            self.mark = torch.random.get_rng_state()  # the base seed's draw is the loader's (judged with it)
            return iterator

        self.undo.append(patch(torch.utils.data.DataLoader, "__iter__", watched_iter))
        return self.undo

    def catch_up(self) -> None:
        """Note a draw from torch's generator since the last mark."""
        if not self.torch_drew and not torch.equal(torch.random.get_rng_state(), self.mark):
            self.torch_drew = True

    @property
    def torch_unseeded(self) -> bool:
        return "torch" not in self.seeded and torch.initial_seed() == self.torch_seed

    def hazards(self) -> list[Hazard]:
        """The global RNGs drawn from and never seeded in this process: certain."""
        self.catch_up()
        drawn = {"torch": self.torch_drew and self.torch_unseeded,
                 "random": "random" not in self.seeded and random.getstate() != self.random_state,
                 "numpy": "numpy" not in self.seeded and _numpy_state() != self.numpy_state}
        names = {"torch": "torch's default generator", "random": "Python's random", "numpy": "numpy's global RNG"}
        return [Hazard(kind="setting", certainty="certain", subject=f"{names[rng]} never seeded",
                       what=(f"the run draws from {names[rng]}, which starts from a seed the operating system gives "
                             "each process: initial weights, dropout masks, shuffles and augmentations change from "
                             "run to run"),
                       fix="call detrace.deterministic(seed) (it seeds torch, random and numpy) before the model is "
                           "built", fixed_by="deterministic", source="detrace audit")
                for rng, drew in drawn.items() if drew]
