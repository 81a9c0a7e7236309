"""Gradient accumulation: 4 microbatches per optimizer step (each loss divided by 4), AdamW with a linear warmup
scheduler; checkpoint (model, optimizer, scheduler, step) every 2 optimizer steps; `--resume` loads the newest.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact; locate deterministic;
audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

ACCUMULATE = 4

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-accum")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    step = saved["step"]

while step < args.steps:
    for micro in range(ACCUMULATE):
        data = torch.Generator().manual_seed(step * ACCUMULATE + micro)
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    step += 1
    print(f"step {step} loss {loss.item() * ACCUMULATE:.6f}")
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step}, folder / f"step-{step}.pt")
