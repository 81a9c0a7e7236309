"""A training loop that checkpoints by itself, as most do: `torch.save` of {model, optimizer, scheduler, RNG, step}
every 2 steps into a folder, and, like torchtitan, a resume from the latest checkpoint there when there is one.
No detrace in it: `detrace check-resume --native --at 4 -- python examples/torch_save_train.py` proves its resume.

    --no-scheduler      a resume bug: the checkpoint leaves the LR scheduler out
    --init_from=resume  nanoGPT-style: resume only when asked (default "auto": whenever there is a checkpoint)
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--ckpt-dir", default="checkpoints")
parser.add_argument("--no-scheduler", action="store_true")
parser.add_argument("--init_from", choices=("auto", "scratch", "resume"), default="auto")
args = parser.parse_args()

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
folder = Path(args.ckpt_dir)
checkpoints = sorted(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
step = 0
if checkpoints and args.init_from != "scratch":
    saved = torch.load(checkpoints[-1])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if "scheduler" in saved:
        scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    step = saved["step"]
while step < args.steps:
    data = torch.Generator().manual_seed(step)  # the data position is the step
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    step += 1
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                 "step": step}
        if not args.no_scheduler:
            saved["scheduler"] = scheduler.state_dict()
        torch.save(saved, folder / f"step-{step}.pt")
    print(f"step {step} loss {loss.item()!r}")
