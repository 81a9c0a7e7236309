"""detrace.parallel.ExpertParallel, torchtitan's expert-parallel style as a drop-in, in one process: a grouped-experts
module keeps its names and global shapes, computes the plain module's outputs, and its weight gradients are the
fixed tree over the step's microbatches (the plain module's own accumulation where M = 2); what it refuses. The
ep1, ep2 check of a whole script runs in tests/e2e/test_topology_examples.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from detrace.errors import UsageError
from detrace.parallel.data import _tree_sum

D, H = 8, 16


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts (its for-loop form): x sorted by expert, expert e run on its rows."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(experts, H, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, D, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, H, D) * D ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, rows in enumerate(x.split(num_tokens_per_expert.tolist())):
            outs.append((nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs)


def _microbatch(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Microbatch i: rows sorted by expert, rows per expert (one expert gets none), the gradient that comes back."""
    g = torch.Generator().manual_seed(i)
    counts = torch.tensor([3 + i, 0, 5, 2 * i + 1])
    rows = int(counts.sum())
    return torch.randn(rows, D, generator=g), counts, torch.randn(rows, D, generator=g)


def _ep_mesh(names: tuple[str, str] = ("dp", "ep")) -> Any:
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=names)["ep"]


def _plain_leaves(plain: GroupedExperts, microbatches: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Each microbatch's outputs and weight gradients alone (loss scaled by 1 / n, n = M at one process)."""
    outs, leaves = [], []
    for i in range(microbatches):
        rows, counts, back = _microbatch(i)
        plain.zero_grad(set_to_none=True)
        out = plain(rows, counts)
        ((out * back).sum() / microbatches).backward()
        outs.append(out.detach())
        leaves.append([p.grad.clone() for p in plain.parameters()])  # type: ignore[union-attr]
    return outs, leaves


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, microbatches: int,
          before_step: list[list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """torchtitan's accumulation: one backward per microbatch, each loss scaled by 1 / n; then the optimizer step,
    whose pre-hook closes the experts' step. Returns the outputs; `before_step` gets the gradients as the step
    finds them (what a gradient clipping or detrace's tracer reads)."""
    outs = []
    for i in range(microbatches):
        rows, counts, back = _microbatch(i)
        out = model(rows, counts)
        ((out * back).sum() / microbatches).backward()
        outs.append(out.detach())
    if before_step is not None:
        before_step.append([p.grad.full_tensor() for p in model.parameters()])  # type: ignore[union-attr]
    optimizer.step()
    return outs


@pytest.mark.parametrize("api", ["detrace", "torch"])
def test_expert_parallel_at_one_process_keeps_the_module_and_sums_its_gradients_in_the_tree(
        one_rank: None, api: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    from detrace.parallel import ExpertParallel, parallelize_module

    plain = GroupedExperts()
    model = copy.deepcopy(plain)
    (parallelize_module if api == "detrace" else torch_parallelize_module)(model, _ep_mesh(), ExpertParallel())
    names = {name: p.shape for name, p in model.named_parameters()}
    assert names == {name: p.shape for name, p in plain.named_parameters()}
    assert all(isinstance(p, DTensor) and p.requires_grad for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients are what is compared
    for microbatches in (4, 2):
        outs, leaves = _plain_leaves(plain, microbatches)
        before: list[list[torch.Tensor]] = []
        got = _step(model, optimizer, microbatches, before)
        for out, mine in zip(outs, got, strict=True):
            assert torch.equal(out, mine)  # the module's own forward, on the same rows
        expected = _tree_sum(leaves)  # the fixed tree over the step's microbatches
        for p, whole, found in zip(model.parameters(), expected, before[0], strict=True):
            assert p.grad is not None and torch.equal(p.grad.full_tensor(), whole)
            assert torch.equal(found, whole)  # in place when the last backward has run, before the optimizer
        if microbatches == 2:  # the tree of two leaves is the plain module's own accumulation
            plain.zero_grad(set_to_none=True)
            for i in range(2):
                rows, counts, back = _microbatch(i)
                ((plain(rows, counts) * back).sum() / 2).backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad.full_tensor(), q.grad)  # type: ignore[union-attr]
        optimizer.zero_grad()
    with torch.no_grad():  # an evaluation's forward opens no step
        rows, counts, _ = _microbatch(0)
        assert torch.equal(model(rows, counts), plain(rows, counts))
    optimizer.step()
    assert all(p.grad is None for p in model.parameters())


class _Mesh:
    """A 1-D mesh of `size` ranks, for the checks that come before any collective."""

    ndim = 1

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_expert_parallel_refuses_what_it_cannot_keep_in_one_sentence(one_rank: None) -> None:
    from detrace.parallel import ExpertParallel, parallelize_module

    refusals: list[tuple[nn.Module, Any, str]] = [
        (GroupedExperts(), init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep")), "takes a 1-D"),
        (GroupedExperts(), _Mesh(3), "power-of-two ep size, not 3"),
        (GroupedExperts(experts=3), _Mesh(2), r"over 2 ranks, which must divide them evenly"),
        (nn.Sequential(nn.Linear(2, 2)), _ep_mesh(), "submodules' parameters"),
        (GroupedExperts(), _ep_mesh(("pp", "ep")), r"sliced from a \(dp, ep\) mesh, not from \('pp', 'ep'\)"),
        (GroupedExperts(), init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "dp"))["ep"], "outside ep"),
    ]
    for module, mesh, message in refusals:
        with pytest.raises(UsageError, match=message):
            parallelize_module(module, mesh, ExpertParallel())
    from torch.distributed.fsdp import fully_shard

    both = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    sharded = GroupedExperts()
    fully_shard(sharded, mesh=both["dp"])
    with pytest.raises(UsageError, match="cannot be given to fully_shard as well"):
        parallelize_module(sharded, both["ep"], ExpertParallel())
    model = GroupedExperts()
    parallelize_module(model, both["ep"], ExpertParallel())
    fully_shard(model, mesh=both["dp"])  # torchtitan's order: the experts' fully_shard over dp after the style
    rows, counts, _ = _microbatch(0)
    with pytest.raises(UsageError, match="pass their weights to fully_shard's ignored_params instead"):
        model(rows, counts)

    def parallel(*modules: nn.Module) -> torch.optim.Optimizer:
        for module in modules:
            parallelize_module(module, _ep_mesh(), ExpertParallel())
        return torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.0)

    model = GroupedExperts()
    optimizer = parallel(model)
    _step(model, optimizer, 4)  # a complete step
    with pytest.raises(UsageError, match=r"hold gradients from before this step; call optimizer\.zero_grad"):
        _step(model, optimizer, 4)
    optimizer.zero_grad()
    with pytest.raises(UsageError, match="took part in 3 microbatches in a step; each rank must run a power-of-two"):
        _step(model, optimizer, 3)
    optimizer.zero_grad()
    _step(model, optimizer, 2)  # the refused step left nothing behind
    model = GroupedExperts()
    optimizer = parallel(model)
    rows, counts, back = _microbatch(0)
    out = torch.utils.checkpoint.checkpoint(model, rows.requires_grad_(True), counts, use_reentrant=False)
    with pytest.raises(UsageError, match="does not support recomputing the experts' forward in a backward"):
        (out * back).sum().backward()
    first, second = GroupedExperts(), GroupedExperts()
    optimizer = parallel(first, second)
    rows, counts, back = _microbatch(0)
    rows = rows.detach()
    (first(rows, counts) * back).sum().backward()
    (second(second(rows, counts), counts) * back).sum().backward()
    with pytest.raises(UsageError, match=r"took part in \[1, 2\] microbatches in one step"):
        optimizer.step()


def test_the_experts_modules_close_their_steps_in_the_order_they_were_parallelized(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close may complete a tree over the experts' dp replicas (a collective: a forward whose backward never ran
    is a zero leaf there): every rank must close the modules in one order, the program's, not a WeakSet's (which
    follows addresses: at dp2xep2 two ranks exchanged block 0's sums with block 1's, and the replicas of one expert
    shard parted)."""
    from detrace.parallel import ExpertParallel, parallelize_module
    from detrace.parallel.expert_parallel import _Experts

    closed: list[int] = []
    write = _Experts.write
    monkeypatch.setattr(_Experts, "write", lambda self, sums: (closed.append(self.order), write(self, sums))[1])
    modules = [GroupedExperts() for _ in range(16)]
    for module in modules:
        parallelize_module(module, _ep_mesh(), ExpertParallel())
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.0)
    rows, counts, _ = _microbatch(0)
    for module in modules:
        module(rows, counts).sum()  # a forward whose backward never runs: zero leaves, pushed as the step closes
    assert not closed
    optimizer.step()
    assert len(closed) == 16 and closed == sorted(closed)
    assert all(not p.grad.to_local().any() for m in modules for p in m.parameters())  # type: ignore[union-attr]
