"""A loop written with accelerate directly, made exactly resumable by detrace, in one of two ways (--mode):

- `register` (the default): `detrace.integrations.accelerate.register(accelerator, data=loader)` with the DataLoader
  that `accelerator.prepare` returned, so that `accelerator.save_state` / `load_state` carry a verified TrainState
  that resumes the loader at its position;
- `beside`: a `detrace.TrainState` of the unwrapped objects kept beside `save_state` / `load_state` by hand, with a
  `ResumableLoader` (not prepared).

    python examples/accelerate_train.py --steps 6 --workers 2
    detrace check-resume --at 2 -- python examples/accelerate_train.py --steps 6 --workers 2   # exact
    detrace check-resume --at 2 -- torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py

accelerate saves the model, optimizer, scheduler and RNG states, but not the position inside an epoch nor the
DataLoader workers' randomness. The TrainState holds all of it, with a verified manifest: the registered prepared
loader (or `ResumableLoader`) seeds each sample, and the TrainState (loaded after `load_state`) restores the RNGs
last.
--report FILE appends one JSON line per run (per rank): the contract variables and the final parameters'
fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

import detrace
from detrace.integrations.accelerate import register
from detrace.state import ResumableLoader, ResumableSampler
from detrace.state.contract import checkpoint_dir, resume_requested, stop_requested


class NoisyPoints(torch.utils.data.Dataset):
    """Fixed points; each read adds Gaussian noise drawn from torch's global RNG."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(samples, 8, generator=generator)
        self.y = torch.randn(samples, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(8), self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--mode", choices=("register", "beside"), default="register")
    parser.add_argument("--report", type=Path, help="append the final parameters' fingerprint to this file")
    options = parser.parse_args()

    torch.set_num_threads(1)
    detrace.deterministic(0)
    accelerator = Accelerator(cpu=True)
    # BatchNorm: under DDP each rank updates its own running statistics (detrace saves each rank's).
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if options.mode == "register":
        loader: Any = torch.utils.data.DataLoader(NoisyPoints(24), batch_size=4, shuffle=True,
                                                  num_workers=options.workers)
        model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
        contract: Any = register(accelerator, data=loader)  # the one line
        step = contract.resume_if_requested()  # accelerator.load_state, then the verified TrainState
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        # Not accelerator.prepare'd: ResumableLoader shards by rank itself and resumes mid-epoch.
        sampler = ResumableSampler(24, seed=0, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
        loader = ResumableLoader(NoisyPoints(24), sampler=sampler, batch_size=4, num_workers=options.workers)
        contract = detrace.TrainState(model=accelerator.unwrap_model(model), optimizer=optimizer.optimizer,
                                      scheduler=scheduler.scheduler, data=loader)
        resume, control = resume_requested()
        if resume and control is None:  # a negative control must not get the RNG states back through accelerate
            accelerator.load_state(str(checkpoint_dir() / "accelerate"))
        step = contract.resume_if_requested()  # after load_state: verified, and the RNGs restored last
    while step < options.steps:
        for x, y in loader:  # the rest of the current epoch
            loss = nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if options.mode == "beside" and step == stop_requested():
                accelerator.save_state(str(checkpoint_dir() / "accelerate"))
            if contract.end_of_step(step) or step == options.steps:  # at DETRACE_STOP_AT: saves, and stops
                break
        else:
            continue  # the epoch ended: the next one
        break

    params = detrace.fingerprint_many(list(accelerator.unwrap_model(model).state_dict().values()))
    digest = "".join(f"{p.digest:016x}" for p in params)
    print(f"final parameters: {digest[:32]}")
    if options.report and accelerator.is_main_process:
        variables = {name: os.environ.get(name) for name in ("DETRACE_STOP_AT", "DETRACE_RESUME", "DETRACE_RESUME_FROM",
                                                              "DETRACE_RESUME_CONTROL")}
        with options.report.open("a") as stream:
            stream.write(json.dumps({**variables, "mode": options.mode, "workers": options.workers,
                                     "params": digest}) + "\n")


if __name__ == "__main__":
    main()
