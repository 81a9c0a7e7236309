"""A small training script that follows detrace's stop/save/resume contract through TrainState.

    python tests/support/scripts/resume_toy.py --steps 6 [--forget-optimizer]

--forget-optimizer  a resume bug: the optimizer (AdamW moments) is not part of the saved state
--unregistered-numpy-rng  a resume bug: the loss is scaled by draws from an np.random.default_rng that TrainState
                    does not hold, so a resumed process draws from its start again
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

import detrace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--forget-optimizer", action="store_true")
    parser.add_argument("--unregistered-numpy-rng", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    detrace.deterministic(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = detrace.TrainState(model=model, optimizer=None if args.forget_optimizer else optimizer)
    start = state.resume_if_requested()
    data = torch.Generator().manual_seed(1)
    noise = np.random.default_rng(0)  # not given to TrainState: the resume bug of --unregistered-numpy-rng
    batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)) for _ in range(args.steps)]
    for step in range(start + 1, args.steps + 1):
        x, y = batches[step - 1]
        loss = nn.functional.mse_loss(model(x), y)
        if args.unregistered_numpy_rng:
            loss = loss * (1 + noise.random() * 1e-3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
        if state.end_of_step(step):
            break


if __name__ == "__main__":
    main()
