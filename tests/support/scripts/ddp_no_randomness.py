"""A plain DDP loop that draws no random number after it starts, as most LLM pretraining: no dropout, the data
order from a seeded `ResumableSampler`, AdamW; it follows the resume contract through `TrainState`.
`detrace check-resume` proves its resume with the data control (the RNG control changes nothing).

    torchrun --nproc-per-node 2 tests/support/scripts/ddp_no_randomness.py [--steps 6]
    python tests/support/scripts/ddp_no_randomness.py   (DDP of one rank)
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import detrace
from detrace._exit import leave
from detrace.state import ResumableLoader, ResumableSampler

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
torch.set_num_threads(1)
detrace.deterministic(0)
rank, world = dist.get_rank(), dist.get_world_size()
data = torch.Generator().manual_seed(1)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=data), torch.randn(64, 1, generator=data))
loader = ResumableLoader(dataset, sampler=ResumableSampler(len(dataset), seed=0, num_replicas=world, rank=rank),
                         batch_size=4)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = detrace.TrainState(model=model, optimizer=optimizer, data=loader)
step = state.resume_if_requested()
while step < args.steps:
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if state.end_of_step(step) or step == args.steps:
            break
    else:
        continue
    break
dist.destroy_process_group()
leave(0)
