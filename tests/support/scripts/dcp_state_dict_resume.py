"""The resume torch's docs teach for torch.distributed.checkpoint, with nothing of detrace: DDP on gloo, a save of
`get_state_dict(model, optimizer)` with `dcp.save` every 2 steps, and with --resume a fresh optimizer's state dict
(`get_state_dict`, which initialises it with a zero-lr optimizer step) filled by `dcp.load` from the latest
checkpoint and handed back with `set_state_dict`."""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
step = 0
folder = Path("ckpt")
if args.resume:
    latest = max(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(latest))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(latest.name.split("-")[1])
while step < args.steps:
    data = torch.Generator().manual_seed(step * 100 + rank)
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if step % 2 == 0:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / f"step-{step}"))
    if rank == 0:
        print(f"step {step} loss {loss.item()!r}")
dist.destroy_process_group()
