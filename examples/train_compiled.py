"""A plain training loop over a `torch.compile`d model that knows nothing of detrace.

    python examples/train_compiled.py --steps 3 --threads 8
    detrace locate -- python examples/train_compiled.py --steps 3     # names the racing Inductor kernel
    python examples/train_compiled.py --deterministic                 # the same model, bit-identical runs

The model gathers rows of a small table with many repeated indices (`table[idx]`). Inductor compiles the
backward of that gather into a C++ kernel whose scatter (an `index_put` with accumulate=True, lowered from the
gather's backward) adds rows with atomic adds from every OpenMP thread: with 2+ threads the order of the adds,
and so the last bits of the table's gradient, change from run to run. The default, 8 threads, is more than a small
machine's cores, so that the race strikes there even when other work keeps the cores busy. `--deterministic`
turns on torch.use_deterministic_algorithms(True) before compiling, which makes Inductor fall back to ATen's
deterministic kernel for that scatter.

`--compile model` compiles the whole model, `--compile blocks` each block on its own (as TorchTitan does);
`--fullgraph` asks for one graph per compiled region, `--graph-break` puts a graph break in every block. The
last line gives a hash of every parameter's bits after training, so two runs compare bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import struct

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, *, graph_break: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.graph_break:
            torch._dynamo.graph_break()  # splits the compiled region in two graphs
        return x + self.mlp(h)


class Model(nn.Module):
    def __init__(self, *, rows: int, dim: int, blocks: int, graph_break: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, dim))
        self.blocks = nn.ModuleList(Block(dim, graph_break=graph_break) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # The backward of this gather adds the gradients of repeated rows together: the racing scatter.
        x = self.table[idx]
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def train(*, steps: int = 3, threads: int = 8, seed: int = 0, deterministic: bool = False, compile: str = "model",
          fullgraph: bool = False, graph_break: bool = False, rows: int = 16, tokens: int = 32768) -> str:
    """Train and return a hash of every parameter's bits after the last step."""
    torch.set_num_threads(threads)
    # Set before compiling: Inductor reads it when it generates code, not when the code runs.
    torch.use_deterministic_algorithms(deterministic)
    torch.manual_seed(seed)
    model = Model(rows=rows, dim=16, blocks=2, graph_break=graph_break)
    run: nn.Module = model
    if compile == "model":
        run = torch.compile(model, fullgraph=fullgraph)
    elif compile == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=fullgraph)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, rows, (tokens,), generator=data)
        target = torch.randn(tokens, generator=data)
        loss = F.mse_loss(run(idx), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f} (0x{struct.pack('>f', loss.item()).hex()})", flush=True)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode() + param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--compile", choices=("model", "blocks", "none"), default="model")
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--graph-break", action="store_true")
    p.add_argument("--rows", type=int, default=16, help="table rows; fewer rows, more colliding adds")
    p.add_argument("--tokens", type=int, default=32768, help="gathered rows per step")
    args = p.parse_args()
    digest = train(steps=args.steps, threads=args.threads, seed=args.seed, deterministic=args.deterministic,
                   compile=args.compile, fullgraph=args.fullgraph, graph_break=args.graph_break, rows=args.rows,
                   tokens=args.tokens)
    print(f"params {digest}", flush=True)


if __name__ == "__main__":
    main()
