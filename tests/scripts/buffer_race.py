"""A plain training loop whose only nondeterminism is in a module buffer: an MoE-style expert-load statistic
updated with `index_put_(accumulate=True)` over many repeated indices, at 2 threads. The parameters, the loss and
the gradients are the same in every run; the buffer is not.

    python tests/scripts/buffer_race.py
    detrace check --runs 3 -- python tests/scripts/buffer_race.py      # differs
    detrace locate -- python tests/scripts/buffer_race.py              # aten.index_put_ in router's forward
"""

from __future__ import annotations

import torch
from torch import nn


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("load", torch.zeros(16))

    def forward(self, x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.load.index_put_((picks,), weights, accumulate=True)
        return self.linear(x)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.Sequential(Router())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(0, 16, (1 << 20,), generator=gen)
    weights = torch.randn(1 << 20, generator=gen)
    for _ in range(3):
        loss = model[0](torch.ones(4, 8), picks, weights).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"load[0] = {model[0].load[0].item()!r}")


if __name__ == "__main__":
    main()
