"""A plain DDP loop with `TrainState` (bucket_cap_mb=0.1, no find_unused_parameters), for the DDP resume test.

Run with torchrun. ARMS (default "pinned") names the arms it runs, one after the other in the same processes,
each on a DDP module of its own (a new DDP module starts on DDP's initial bucket layout, as in a fresh process):
"pinned" is the TrainState as it is; "unpinned" leaves DDP's bucket layout alone, as detrace did before it pinned
it: the arm that shows why it must. Each arm follows the contract (DETRACE_CKPT_DIR, DETRACE_CKPT_EVERY,
DETRACE_RESUME_FROM, ...) with "{arm}" in their values replaced by its name, and appends one JSON line per rank to
REPORT: the arm, the rank, whether the run was resumed, the final parameters' digest and the mean wall time of a
step after the first.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import detrace
from detrace._exit import leave
from detrace.state import train_state

CONTRACT = ("DETRACE_CKPT_DIR", "DETRACE_CKPT_EVERY", "DETRACE_RESUME_FROM", "DETRACE_STOP_AT", "DETRACE_RESUME")


def run_arm(arm: str, rank: int) -> None:
    contract = {name: os.environ[name] for name in CONTRACT if name in os.environ}
    os.environ.update({name: value.replace("{arm}", arm) for name, value in contract.items()})
    pin_layout = train_state.pin_layout
    if arm == "unpinned":
        train_state.pin_layout = lambda model: None  # the old behaviour
    torch.manual_seed(0)
    width = int(os.environ.get("WIDTH", "256"))
    model = DDP(nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                              nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)), bucket_cap_mb=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = detrace.TrainState(model=model, optimizer=optimizer)
    train_state.pin_layout = pin_layout
    step = state.resume_if_requested()
    steps = int(os.environ.get("STEPS", "6"))
    times = []
    while step < steps:
        began = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * step + rank)  # the data: a function of (step, rank)
        x = torch.randn(64, 32, generator=generator) / 3
        loss = (model(x) - 1).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        times.append(time.perf_counter() - began)
        if state.end_of_step(step):
            break
    params = detrace.fingerprint_many([p.detach() for p in model.parameters()])
    with open(os.environ["REPORT"], "a") as stream:
        stream.write(json.dumps({"arm": arm, "rank": rank, "resumed": bool(os.environ.get("DETRACE_RESUME_FROM")),
                                 "params": "".join(f"{p.digest:016x}" for p in params),
                                 "step_s": sum(times[1:]) / max(1, len(times) - 1)}) + "\n")
    os.environ.update(contract)


dist.init_process_group("gloo")
torch.set_num_threads(1)
for name in os.environ.get("ARMS", "pinned").split(","):
    run_arm(name, dist.get_rank())
    dist.barrier()
dist.destroy_process_group()
leave(0)
