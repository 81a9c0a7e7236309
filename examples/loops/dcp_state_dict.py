"""The resume torch.distributed.checkpoint's docs teach, in one process on gloo: get_state_dict / dcp.save every 2
steps, and with `--resume` dcp.load / set_state_dict of the newest one. (get_state_dict on the resumed run's fresh
optimizer runs torch's own zero-lr step to create its state: not a training step.)

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact; locate deterministic;
audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt-dir", default="ckpt-dcp")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=newest)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(newest.name.split("-")[1])

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
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder / f"step-{step}")
dist.destroy_process_group()
