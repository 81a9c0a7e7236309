"""A small training loop that gathers rows with repeated indices (backward: an accumulating index_put whose two threads
race). `--deterministic` turns on torch.use_deterministic_algorithms, `--small` makes every run cheap, `--lr=X` is
an intentional change and `--pool` races in the forward too (detrace compare).

    python tests/support/scripts/train_gather.py STEPS [--deterministic] [--small] [--lr=X] [--pool]
"""
import sys

import torch
from torch import nn

torch.set_num_threads(2)
torch.use_deterministic_algorithms("--deterministic" in sys.argv)
torch.manual_seed(0)
# large enough for the two threads to race at almost every call (~0.1 s a call)
ROWS, COPIES = (1024, 4096) if "--small" in sys.argv else (8192, 131072)


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.randint(0, ROWS, (COPIES,), generator=torch.Generator().manual_seed(1)))
        # a weight per copy: equal addends would sum to the same bits in any order
        self.register_buffer("scale", torch.rand(COPIES, 1, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        rows = x[self.idx] * self.scale
        if "--pool" in sys.argv:  # sum the copies back per row: the forward races too, so the loss varies
            return torch.zeros_like(x).index_put((self.idx,), rows, accumulate=True)
        return rows


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gather, self.out = nn.Linear(16, 16), Gather(), nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.out(self.gather(self.inp(x))))


model = Net()
lr = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--lr=")), 0.01))
opt = torch.optim.SGD(model.parameters(), lr=lr)
data = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(2))

for _ in range(int(sys.argv[1])):
    out = model(data)
    # --pool: a float64 loss keeps the last bits that a float32 mean over 131072 values would round away
    (out.double() if "--pool" in sys.argv else out).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
