"""Module attribution in the backward: an op run in the backward belongs to the module whose forward created the
autograd node running it (a custom autograd.Function's included), never to whichever module's backward ran just
before. Code in the root model's forward belongs to the root ("")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import detrace
from detrace.tracefile import read_rank


class Gather(torch.autograd.Function):
    """An embedding lookup whose backward accumulates with index_put_ (nondeterministic with repeated indices)."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = table.shape[0]
        return table[ids]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows, grad.shape[-1])
        out.index_put_((ids.reshape(-1),), grad.reshape(-1, grad.shape[-1]), accumulate=True)
        return out, None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class GPT(nn.Module):
    """nanoGPT-style: the token table is a bare parameter of the root, applied by a custom Function in the root's
    forward; the positions are an nn.Embedding, whose backward the engine reaches just before the token's."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.randn(32, 8))
        self.pos = nn.Embedding(6, 8)
        self.block = Block()
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = Gather.apply(self.tok, ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.block(x))


def test_a_custom_functions_backward_belongs_to_the_module_that_applied_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT()
    ids = torch.randint(0, 32, (4, 6))
    with detrace.trace(tmp_path / "t", rung="op"):
        model(ids).sum().backward()
        detrace.step()
    rows = read_rank(tmp_path / "t", 0).table.to_pylist()
    backward = {(r["name"], r["module"]) for r in rows if r["phase"] == "backward" and r["rung"] == "op"}
    index_put = {module for name, module in backward if name == "aten.index_put_.default"}
    assert index_put == {""}, backward  # the root, whose forward applied Gather: not "pos"
    embedding = {module for name, module in backward if name == "aten.embedding_dense_backward.default"}
    assert embedding == {"pos"}
    assert {module for name, module in backward if name == "aten.mm.default"} <= {"head", "block.mlp"}
