"""A plain PyTorch training script that knows nothing of detrace: a tiny top-4 mixture-of-experts MLP
whose token dispatch uses advanced indexing, the common hand-written way.

    python examples/plain_moe_train.py --steps 8 --threads 8
    detrace run -- python examples/plain_moe_train.py --steps 8        # the tracer, injected from outside
    detrace check -- python examples/plain_moe_train.py --steps 8      # two runs: are they bit-identical?

With 2+ threads the backward of `x[token]` (aten.index_put with accumulate=True over repeated indices) adds
in an order that changes from run to run, so two runs from the same seed differ in their last bits;
`--deterministic` turns on torch.use_deterministic_algorithms(True) and they no longer do. The default is 8
threads, more than a small machine's cores: the operating system then interleaves them, so the race strikes even
where other work keeps the cores busy (there, 2 threads often run their halves of the backward one after the
other, in the same order, and two runs agree bit for bit).
"""

from __future__ import annotations

import argparse
import struct

import torch
import torch.nn.functional as F
from torch import nn


class TinyMoE(nn.Module):
    def __init__(self, dim: int = 64, experts: int = 8, top_k: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.top_k = top_k
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 128), nn.SiLU(), nn.Linear(128, dim)) for _ in range(experts)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)  # [N, D]
        weights, chosen = F.softmax(self.router(x), -1).topk(self.top_k, -1)  # [N, k]
        # by expert, each expert's tokens in priority order (descending router weight): two stable sorts
        by_weight = weights.flatten().argsort(descending=True, stable=True)
        order = by_weight[chosen.flatten()[by_weight].argsort(stable=True)]
        token = order // self.top_k  # each token appears top_k times
        routed = x[token]  # dispatch; backward: index_put(accumulate=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out = torch.cat([e(part) for e, part in zip(self.experts, routed.split(counts), strict=True)])
        out = out * weights.flatten()[order, None]
        y = torch.zeros_like(x).index_add_(0, token, out)  # combine
        return self.head(x + y).view(*tokens.shape, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(args.deterministic)
    torch.manual_seed(args.seed)
    model = TinyMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 256, (8, 33), generator=data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step - 1} loss {loss.item():.6f} (0x{struct.pack('>f', loss.item()).hex()})", flush=True)


if __name__ == "__main__":
    main()
