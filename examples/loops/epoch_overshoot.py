"""An epoch loop (2 epochs of 4 batches) that checkpoints every 2 steps and, by a common slip, records the epoch to
resume from as `epoch + 1` (right only at the end of an epoch). A resume from step 6 (mid second epoch) starts at
epoch 2 and trains no step at all; from step 4 (an epoch's end) it is right.

True verdicts: check identical; check-resume --native --at 6 --resume-args=--resume resume-changed-the-run (the
resumed run trains nothing after step 6; the continuous run goes on to step 8); at 4: exact; locate deterministic;
audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

EPOCHS, BATCHES = 2, 4

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", default="ckpt-epoch")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
start_epoch, step = 0, 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start_epoch, step = saved["epoch"], saved["step"]

for epoch in range(start_epoch, EPOCHS):
    for batch in range(step - epoch * BATCHES, BATCHES):
        data = torch.Generator().manual_seed(epoch * BATCHES + batch)
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        print(f"epoch {epoch} step {step} loss {loss.item():.6f}")
        if step % 2 == 0:
            folder.mkdir(exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                        "step": step}, folder / f"step-{step}.pt")
