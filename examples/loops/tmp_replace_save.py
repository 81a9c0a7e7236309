"""A model with dropout whose checkpoint (model, optimizer, torch RNG, step) is written the careful way: torch.save
to a temporary file, then os.replace onto the final name, so a crash never leaves half a checkpoint.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact; locate deterministic;
audit finds no certain hazard.
"""

import argparse
import os
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-tmp")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    saved = torch.load(folder / "last.pt")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    step = saved["step"]

while step < args.steps:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    print(f"step {step} loss {loss.item():.6f}")
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        tmp = folder / "last.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "step": step}, tmp)
        os.replace(tmp, folder / "last.pt")
