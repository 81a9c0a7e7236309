"""A nanoGPT-style training script that knows nothing of detrace, for `detrace audit` (tests/integration/test_audit.py).

    torchrun --standalone --nproc-per-node 2 tests/support/scripts/audit_nanogpt.py     # DDP over gloo
    python tests/support/scripts/audit_nanogpt.py                                      # one process

Written the way such scripts usually are, with the hazards that go with them: DDP with its default bucket
rebuild, a shuffling DataLoader with a worker and no worker_init_fn or generator, and a collate_fn that draws
a random crop offset from Python's global RNG.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

BLOCK = 16
VOCAB = 64


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, BLOCK + 4), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def random_crop(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    start = random.randint(0, 3)  # the augmentation: a random offset into each sequence
    x = torch.stack([row[start:start + BLOCK] for row in batch])
    y = torch.stack([row[start + 1:start + BLOCK + 1] for row in batch])
    return x, y


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(BLOCK, dim)
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.blocks(x))


def main() -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(1337)
    model: nn.Module = GPT()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Tokens(64), batch_size=8, shuffle=True, num_workers=1, collate_fn=random_crop)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step == 2:
            break
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
