"""A training DataLoader (shuffled, a new order each epoch from a generator seeded with the epoch) and, after each
checkpoint, a validation DataLoader iterated with grad enabled and only its forward under torch.no_grad(), as HF
Trainer's evaluation loop does. Every 2 steps the script saves (model, optimizer, step); `--resume` loads the
newest checkpoint and skips the batches of the epoch already trained on. `--no-eval-mode` forgets model.eval()
around the validation (the model has no dropout and no BatchNorm, so the loss is the same).

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact (with --no-eval-mode too);
locate deterministic; audit finds no certain hazard; each step's samples are the training loader's batch.
"""

import argparse
import itertools
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-val")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--no-eval-mode", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.Generator().manual_seed(1234)
train_set = TensorDataset(torch.randn(40, 8, generator=data), torch.randn(40, 1, generator=data))
val_set = TensorDataset(torch.randn(24, 8, generator=data), torch.randn(24, 1, generator=data))
order = torch.Generator()
train_loader = DataLoader(train_set, batch_size=8, shuffle=True, generator=order)
val_loader = DataLoader(val_set, batch_size=8, generator=torch.Generator().manual_seed(0))
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
    epoch, done = divmod(step, len(train_loader))
    order.manual_seed(epoch)
    for x, y in itertools.islice(train_loader, done, None):
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
            if not args.no_eval_mode:
                model.eval()
            total = 0.0
            for vx, vy in val_loader:
                with torch.no_grad():
                    total += nn.functional.mse_loss(model(vx), vy).item()
            model.train()
            print(f"step {step} validation loss {total / len(val_loader):.6f}")
        if step == args.steps:
            break
