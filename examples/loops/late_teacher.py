"""Distillation switched on late: a frozen teacher (a pretrained model, in eval mode, no parameter requires grad)
is called under torch.no_grad() on each training batch from step `--teacher-from` on, and the student learns from
its outputs as well as the labels. Every 2 steps the script saves (student, optimizer, step); `--resume` loads the
newest checkpoint. The data of each step comes from a generator seeded with the step.

True verdicts: check identical; check-resume --native --at 2 --resume-args=--resume exact (and at 4, after the
teacher came in); locate deterministic; audit finds no certain hazard.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--teacher-from", type=int, default=3)
parser.add_argument("--ckpt-dir", default="ckpt-teacher")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
teacher.eval()
teacher.requires_grad_(False)
student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
folder = Path(args.ckpt_dir)
step = 0
if args.resume:
    newest = max(folder.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    saved = torch.load(newest)
    student.load_state_dict(saved["student"])
    optimizer.load_state_dict(saved["optimizer"])
    step = saved["step"]

while step < args.steps:
    data = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)
    if step + 1 >= args.teacher_from:
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
    logits = student(x)
    loss = nn.functional.cross_entropy(logits, y)
    if step + 1 >= args.teacher_from:
        loss = loss + nn.functional.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    print(f"step {step} loss {loss.item():.6f}")
    if step % 2 == 0:
        folder.mkdir(exist_ok=True)
        torch.save({"student": student.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   folder / f"step-{step}.pt")
