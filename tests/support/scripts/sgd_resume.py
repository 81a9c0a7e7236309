"""A loop with plain SGD (it keeps no step count) and dropout that checkpoints by itself with `torch.save` every 2
steps (the model, the optimizer, torch's RNG state, the step) and resumes from the latest checkpoint in its folder
when there is one. No detrace in it.

    --momentum       SGD with momentum (its state: a momentum buffer per parameter, still no step count)
    --no-optimizer   a resume bug: the checkpoint leaves the optimizer out
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--momentum", action="store_true")
parser.add_argument("--no-optimizer", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if args.momentum else 0.0)
folder = Path("checkpoints")
checkpoints = sorted(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
step = 0
if checkpoints:
    saved = torch.load(checkpoints[-1])
    model.load_state_dict(saved["model"])
    if "optimizer" in saved:
        optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    step = saved["step"]
while step < args.steps:
    data = torch.Generator().manual_seed(step)  # the data position is the step
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        saved = {"model": model.state_dict(), "rng": torch.get_rng_state(), "step": step}
        if not args.no_optimizer:
            saved["optimizer"] = optimizer.state_dict()
        torch.save(saved, folder / f"step-{step}.pt")
    print(f"step {step} loss {loss.item()!r}")
