"""Count the model's FLOPs the way litgpt does before training: a forward and backward on a meta-device copy under
torch.utils.flop_counter.FlopCounterMode, then the real training (AdamW, checkpoint every 2 steps, `--resume`).

True verdicts: the program runs to its end under every command (the meta tensors hold no data to record); check
identical; check-resume --native --at 2 --resume-args=--resume exact; locate deterministic; audit finds no certain
hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-flops")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


torch.set_num_threads(1)
with torch.device("meta"):
    meta_model = build()
with FlopCounterMode(display=False) as counter:
    meta_model(torch.empty(16, 8, device="meta")).sum().backward()
print(f"FLOPs per step: {counter.get_total_flops()}")

torch.manual_seed(0)
model = build()
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
