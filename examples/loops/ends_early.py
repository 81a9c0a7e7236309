"""A correct AdamW loop with a checkpoint every 2 steps, resumed by a command that asks for fewer steps than the
first launch did (`--resume --steps 4` after a run launched with `--steps 6`: the resumed run trains a correct
prefix and ends early).

True verdicts: check identical; check-resume --native --at 2 --resume-args="--resume --steps 4" --
... --steps 6: resume-changed-the-run (the resumed run stops at step 4, the continuous one at 6); with
--resume-args=--resume: exact; locate deterministic; audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-early")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
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
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   folder / f"step-{step}.pt")
