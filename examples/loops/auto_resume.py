"""A framework-style auto-resume: at start the script loads the newest checkpoint in its own folder if there is one
(model, optimizer, torch RNG, step), with dropout drawing from the RNG. No flag asks for the resume.

True verdicts: check-resume --native --at 2 exact (no --resume-args: the script finds its checkpoint); check on a
clean folder: run 2 resumes from run 1's checkpoints, so the runs are not from the same state: a refusal naming the
folder (exit 2), not a verdict; locate: the same refusal or deterministic; audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-auto")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
step = 0
checkpoints = sorted(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
if checkpoints:
    saved = torch.load(checkpoints[-1])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    step = saved["step"]
    print(f"resumed from {checkpoints[-1]}")

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
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "step": step}, folder / f"step-{step}.pt")
