"""The scripts of docs/audit.md's precision table: each a small training (6 steps at 2 threads, unless it says
otherwise) that exercises one op of torch's documented list, one seeding or data case, compiled code, DDP, or a
framework. bench/audit_precision.py runs `detrace audit` and `detrace check` on each, as real processes, and
prints the table; tests/integration/test_audit.py runs the light ones' code under the probe in process and holds
the audit to what `check` observed (`observed`).

Each script's source is `HEAD` + its body: `w` (a 64x8 parameter) is trained on `loss`, which the body defines
from `w` and the step `step`. Indices are drawn from a seeded generator `G`, many (200,000 into 64 rows) so a race
strikes in any run at 2 threads.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD = """\
import os, random, sys
import numpy as np
import torch
import torch.nn.functional as F
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
G = torch.Generator().manual_seed(1)
"""

LOOP = """\
w = torch.nn.Parameter(torch.randn(64, 8, generator=G))
opt = torch.optim.SGD([w], lr=0.01)
idx = torch.randint(0, 64, (200000,), generator=G)
src = torch.randn(200000, 8, generator=G)
for step in range(6):
{body}
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One script of the table."""

    name: str
    """What it exercises."""
    source: str
    """The whole script."""
    observed: bool
    """Whether `detrace check` (2 runs) saw the runs differ on this machine (2 cores, torch 2.13, CPU), as
    bench/audit_precision.py measured it."""
    light: bool = True
    """Runs in process under the probe in the suite (no workers, no compile, no process group, no framework)."""
    launcher: tuple[str, ...] = ()
    """Arguments before the script ("-m torch.distributed.run ..."); () for python."""


def _loop(body: str, *, seed: bool = True, threads: int = 2) -> str:
    lines = "\n".join(f"    {line}" for line in body.strip().splitlines())
    head = HEAD.replace('"2"', f'"{threads}"')
    return head + ("torch.manual_seed(0)\n" if seed else "") + LOOP.format(body=lines)


_OPS: dict[str, tuple[str, bool]] = {
    # name: (body, observed by check)
    "index_put_ accumulate=True, repeated indices": (
        "loss = (torch.zeros(64, 8).index_put_((idx,), src, accumulate=True) * w).sum()", True),
    "index_put_ accumulate=False, repeated indices": (
        "loss = (torch.zeros(64, 8).index_put_((idx,), src) * w).sum()", True),
    "index_copy_, repeated indices": ("loss = (torch.zeros(64, 8).index_copy_(0, idx, src) * w).sum()", True),
    "put_ accumulate=True, repeated indices": (
        "loss = (torch.zeros(512).put_(idx, src[:, 0], accumulate=True).view(64, 8) * w).sum()", True),
    "put_ accumulate=False, repeated indices": (
        "loss = (torch.zeros(512).put_(idx, src[:, 0]).view(64, 8) * w).sum()", True),
    "x[idx] backward (index_put), repeated indices": ("loss = (w[idx] * src).sum()", True),
    "MaxUnpool1d, repeated indices": (
        "loss = (F.max_unpool1d(src[:, 0].view(1, 1, -1), idx.view(1, 1, -1), 1)[0, 0, :512].view(64, 8) * w)"
        ".sum()", True),
    "index_put_ accumulate=True, distinct indices": (
        "loss = (torch.zeros(64, 8).index_put_((torch.arange(64),), src[:64], accumulate=True) * w).sum()", False),
    "index_copy_, distinct indices": (
        "loss = (torch.zeros(64, 8).index_copy_(0, torch.arange(64), src[:64]) * w).sum()", False),
    "index_add_ (CUDA only)": ("loss = (torch.zeros(64, 8).index_add_(0, idx, src) * w).sum()", False),
    "scatter_add_ (CUDA only)": (
        "loss = (torch.zeros(64, 8).scatter_add_(0, idx[:, None].expand(-1, 8), src) * w).sum()", False),
    "scatter_ with a src tensor (CUDA only)": (
        "loss = (torch.zeros(64, 8).scatter_(0, idx[:, None].expand(-1, 8), src) * w).sum()", False),
    "scatter_reduce_ sum (CUDA only)": (
        "loss = (torch.zeros(64, 8).scatter_reduce_(0, idx[:, None].expand(-1, 8), src, 'sum') * w).sum()", False),
    "index_reduce_ prod (CUDA only)": (
        "loss = (torch.ones(64, 8).index_reduce_(0, idx[:1000], src[:1000].sigmoid(), 'prod') * w).sum()", False),
    "gather backward (CUDA only)": (
        "loss = (w.gather(0, idx[:, None].expand(-1, 8)) * src).sum()", False),
    "index_select backward (CUDA only)": ("loss = (w.index_select(0, idx) * src).sum()", False),
    "repeat_interleave backward (CUDA only)": (
        "loss = (w.repeat_interleave(torch.full((64,), 3), dim=0) * src[:192]).sum()", False),
    "EmbeddingBag max backward (CUDA only)": (
        "loss = F.embedding_bag(idx[:4000], w, torch.arange(0, 4000, 40), mode='max').sum()", False),
    "histc (CUDA only)": ("loss = (w * torch.histc(src[:, 0], bins=8)).sum()", False),
    "bincount with weights (CUDA only)": (
        "loss = (w * torch.bincount(idx, weights=src[:, 0], minlength=64)[:, None]).sum()", False),
    "cumsum of floats (CUDA only)": ("loss = (w.cumsum(0) * src[:64]).sum()", False),
    "median with indices (CUDA only)": ("loss = w.median(dim=0).values.sum()", False),
    "interpolate bilinear backward (CUDA only)": (
        "loss = F.interpolate(w.view(1, 1, 64, 8), scale_factor=2, mode='bilinear').sum()", False),
    "AdaptiveAvgPool2d backward (CUDA only)": ("loss = F.adaptive_avg_pool2d(w.view(1, 1, 64, 8), 3).sum()", False),
    "AdaptiveMaxPool2d backward (CUDA only)": ("loss = F.adaptive_max_pool2d(w.view(1, 1, 64, 8), 3).sum()", False),
    "AvgPool3d backward (CUDA only)": ("loss = F.avg_pool3d(w.view(1, 1, 4, 16, 8), 2).sum()", False),
    "MaxPool3d backward (CUDA only)": ("loss = F.max_pool3d(w.view(1, 1, 4, 16, 8), 2).sum()", False),
    "ReflectionPad2d backward (CUDA only)": ("loss = (F.pad(w.view(1, 1, 64, 8), (2, 2, 2, 2), 'reflect') ** 2).sum()",
                                             False),
    "ReplicationPad2d backward (CUDA only)": (
        "loss = (F.pad(w.view(1, 1, 64, 8), (2, 2, 2, 2), 'replicate') ** 2).sum()", False),
    "grid_sample backward (CUDA only)": (
        "loss = F.grid_sample(w.view(1, 1, 64, 8), src[:32].view(1, 4, 32, 2).tanh(), align_corners=False).sum()",
        False),
    "Conv2d (CUDA only)": ("loss = F.conv2d(w.view(1, 1, 64, 8), torch.ones(2, 1, 3, 3)).sum()", False),
    "NLLLoss 2d (CUDA only)": (
        "loss = F.nll_loss(w.view(1, 8, 8, 8).log_softmax(1), idx[:64].view(1, 8, 8) % 8)", False),
    "CTCLoss backward (CUDA only)": (
        "loss = F.ctc_loss(w.view(16, 4, 8).log_softmax(2), (idx[:12] % 7 + 1).view(4, 3), torch.full((4,), 16), "
        "torch.full((4,), 3))", False),
}

CASES: tuple[Case, ...] = (
    *(Case(name=name, source=_loop(body), observed=observed) for name, (body, observed) in _OPS.items()),
    Case(name="index_put_ accumulate=True, repeated indices, 1 thread",
         source=_loop(_OPS["index_put_ accumulate=True, repeated indices"][0], threads=1), observed=False),
    Case(name="x[idx] backward under detrace.deterministic()",
         source=_loop("loss = (w[idx] * src).sum()").replace("torch.manual_seed(0)\n",
                                                               "import detrace\ndetrace.deterministic(0)\n"),
         observed=False),
    Case(name="torch's generator never seeded (dropout)", source=_loop("loss = (F.dropout(w, 0.5) ** 2).sum()",
                                                                       seed=False), observed=True),
    Case(name="torch's generator seeded (dropout)", source=_loop("loss = (F.dropout(w, 0.5) ** 2).sum()"),
         observed=False),
    Case(name="Python's random never seeded", source=_loop("loss = (w * random.random()).sum()"), observed=True),
    Case(name="numpy's RNG never seeded", source=_loop("loss = (w * float(np.random.rand())).sum()"), observed=True),
    Case(name="training in a thread, x[idx] backward",
         source=HEAD + "torch.manual_seed(0)\nimport threading\ndef train():\n"
                + "\n".join(f"    {line}" for line in LOOP.format(body="    loss = (w[idx] * src).sum()").splitlines())
                + "\nt = threading.Thread(target=train)\nt.start()\nt.join()\n", observed=True),
)

_LOADER = HEAD + """\
{seed}
class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.rand(8)  # an augmentation, drawn in the worker
w = torch.nn.Parameter(torch.zeros(8))
opt = torch.optim.SGD([w], lr=0.1)
loader = torch.utils.data.DataLoader(Noisy(), batch_size=8, num_workers=2{generator})
for step, batch in enumerate(loader):
    ((w - batch) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 2:
        break
"""

_COMPILED = HEAD + """\
{recipe}
table = torch.nn.Parameter(torch.randn(64, 8, generator=G))
opt = torch.optim.SGD([table], lr=0.1)
idx = torch.randint(0, 64, (100000,), generator=G)
scale = torch.randn(100000, 8, generator=G)  # gradients that do not add exactly in every order (2.0s would)
step_fn = torch.compile(lambda t: (t[idx] * scale).sum())
for step in range(6):
    step_fn(table).backward()
    opt.step()
    opt.zero_grad()
"""

_DDP = HEAD + """\
import torch.distributed as dist
import detrace
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{recipe}
x = torch.randn(8, 16, generator=G)
for step in range(6):
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

_HF = HEAD + """\
import transformers
from detrace.integrations.hf import DetraceCallback
config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
args = transformers.TrainingArguments(output_dir=sys.argv[1] if len(sys.argv) > 1 else "hf-out", max_steps=2,
                                      per_device_train_batch_size=4, report_to=[], save_strategy="no",
                                      use_cpu=True, seed=0, logging_steps=1)
transformers.set_seed(0)
model = transformers.GPT2LMHeadModel(config)
transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[DetraceCallback()]).train()
"""

_LIGHTNING = HEAD + """\
import lightning as L
from detrace.integrations.lightning import DetraceCallback
L.seed_everything(0)
class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, i):
        return self.layer(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.randn(32, 8, generator=G), batch_size=8, shuffle=True)
L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
          enable_progress_bar=False, enable_model_summary=False, callbacks=[DetraceCallback()]).fit(Model(), data)
"""

_TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")

HEAVY: tuple[Case, ...] = (
    Case(name="DataLoader workers drawing, never seeded", source=_LOADER.format(seed="", generator=""),
         observed=True, light=False),
    Case(name="DataLoader workers drawing, torch seeded", source=_LOADER.format(seed="torch.manual_seed(0)",
                                                                                  generator=""),
         observed=False, light=False),
    Case(name="DataLoader workers drawing, a seeded generator",
         source=_LOADER.format(seed="", generator=", generator=torch.Generator().manual_seed(0)"),
         observed=False, light=False),
    Case(name="compiled x[idx] backward (atomic C++ kernel)", source=_COMPILED.format(recipe=""), observed=True,
         light=False),
    Case(name="compiled x[idx] backward under detrace.deterministic()",
         source=_COMPILED.format(recipe="import detrace\ndetrace.deterministic(0)"), observed=False, light=False),
    Case(name="DDP x2 without the recipe", source=_DDP.format(recipe=""), observed=False, light=False,
         launcher=_TORCHRUN),
    Case(name="DDP x2 with a TrainState", source=_DDP.format(recipe="state = detrace.TrainState(model=model, "
                                                                       "optimizer=opt)"),
         observed=False, light=False, launcher=_TORCHRUN),
    Case(name="HF Trainer with the callback", source=_HF, observed=False, light=False),
    Case(name="Lightning with the callback", source=_LIGHTNING, observed=False, light=False),
)
