"""An EMA copy of the model (updated after every step, saved at the end for inference) that the checkpoint forgets:
the checkpoint holds the model and the optimizer, and a resumed run starts its EMA again from the loaded weights.

With `--eval-only` the EMA is not saved at the end: it is evaluated on a validation batch at every checkpoint step
instead (the number a user reads in the log), so the resume changes the printed validation losses.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume resume-changed-the-run (the
EMA differs; the model and the optimizer are equal; with --eval-only too, by the EMA's validation losses); locate
deterministic; audit finds no certain hazard.
"""

import argparse
import copy
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-ema")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--eval-only", action="store_true")
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
ema = copy.deepcopy(model).requires_grad_(False)  # the bug: made from the loaded weights, not saved nor loaded

while step < args.steps:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for averaged, current in zip(ema.parameters(), model.parameters(), strict=True):
            averaged.lerp_(current, 0.1)
    step += 1
    print(f"step {step} loss {loss.item():.6f}")
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   folder / f"step-{step}.pt")
        if args.eval_only:
            validation = torch.Generator().manual_seed(1234)
            with torch.no_grad():
                val_x, val_y = torch.randn(32, 8, generator=validation), torch.randn(32, 1, generator=validation)
                print(f"step {step} EMA validation loss {nn.functional.mse_loss(ema(val_x), val_y).item():.6f}")
if not args.eval_only:
    torch.save(ema.state_dict(), folder / "ema.pt")
