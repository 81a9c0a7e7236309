"""SGD with momentum, checkpointed with torch.save every 2 steps; `--resume` loads the newest checkpoint.

SGD keeps no step count in its state, so the resumed run's step is the checkpoint's. With `--no-optimizer` the
checkpoint leaves the optimizer (its momentum buffers) out.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact (with --no-optimizer:
resume-changed-the-run, the optimizer named); locate deterministic; audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-sgd")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--no-optimizer", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
    model.load_state_dict(saved["model"])
    if "optimizer" in saved:
        optimizer.load_state_dict(saved["optimizer"])
    step = saved["step"]

while step < args.steps:
    data = torch.Generator().manual_seed(step)  # the batch is a function of the step
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    print(f"step {step} loss {loss.item():.6f}")
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        state = {"model": model.state_dict(), "step": step}
        if not args.no_optimizer:
            state["optimizer"] = optimizer.state_dict()
        torch.save(state, folder / f"step-{step}.pt")
