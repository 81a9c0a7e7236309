"""Evaluation at checkpoint steps: every 2 steps the script saves (model, optimizer, torch RNG, step), then switches
to model.eval(), measures the validation loss under torch.no_grad(), and goes back to model.train(). The model has
dropout (a draw from the RNG in training only).

With `--loader`, the validation set is read through a DataLoader (shuffle off): its iterator draws a base seed from
torch's RNG after the checkpoint was taken, so the continuous run's later dropout masks are not the resumed run's.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact (the evaluation draws
nothing; with --loader: resume-changed-the-run, the torch RNG state differs); locate deterministic; audit finds no
certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-eval")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--loader", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
validation = torch.Generator().manual_seed(1234)
val_x, val_y = torch.randn(32, 8, generator=validation), torch.randn(32, 1, generator=validation)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
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
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                    "step": step}, folder / f"step-{step}.pt")
        model.eval()
        with torch.no_grad():
            if args.loader:
                batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(val_x, val_y), batch_size=32)
                val_loss = sum(nn.functional.mse_loss(model(x), y) for x, y in batches)
            else:
                val_loss = nn.functional.mse_loss(model(val_x), val_y)
        model.train()
        print(f"step {step} validation loss {val_loss.item():.6f}")
