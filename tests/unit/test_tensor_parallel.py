"""Tensor-parallel layers whose bits do not depend on the TP size: T = 1, 2, 4 simulated in one process (one
thread per rank, the exchange by a barrier), forward and backward, against T = 1; and plain TP's difference."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace.errors import UsageError
from detrace.parallel.data import _tree_sum
from detrace.parallel.tensor import ColumnParallelLinear, Combine, RowParallelLinear, owned_chunks


class _SimulatedGroup:
    """T ranks as threads: `combine(rank)` exchanges partial sums through shared slots and a barrier, then
    completes them as the real group would: the fixed tree over the ranks' blocks (invariant), or the sum in
    rank order of an all-reduce (plain)."""

    def __init__(self, size: int, mode: str) -> None:
        self.size, self.mode = size, mode
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def combine(self, rank: int) -> Combine:
        def complete(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            parts = [p.clone() for p in self.slots if p is not None]
            self.barrier.wait()
            if self.mode == "invariant":
                return _tree_sum([[p] for p in parts])[0]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            return total
        return complete


@dataclass
class _Case:
    x: torch.Tensor  # [rows, d_in]
    w1: torch.Tensor  # [hidden, d_in]: column-parallel
    w2: torch.Tensor  # [d_out, hidden]: row-parallel
    gy: torch.Tensor  # [rows, d_out]: the gradient fed back
    c1: int
    c2: int


def _case(rows: int, d_in: int, n1: int, c1: int, c2: int, d_out: int, seed: int) -> _Case:
    g = torch.Generator().manual_seed(seed)
    hidden = n1 * c1
    assert hidden % c2 == 0
    return _Case(x=torch.randn(rows, d_in, generator=g), w1=torch.randn(hidden, d_in, generator=g) / d_in**0.5,
                 w2=torch.randn(d_out, hidden, generator=g) / hidden**0.5, gy=torch.randn(rows, d_out, generator=g),
                 c1=c1, c2=c2)


def _run(case: _Case, size: int, mode: str) -> dict[str, torch.Tensor]:
    """y = row(relu(column(x))) on `size` simulated ranks; backward from gy. Every rank's y and x.grad (which
    must agree) and every chunk's gradient, by global name."""
    group = _SimulatedGroup(size, mode)
    results: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            col = ColumnParallelLinear(case.w1, chunk=case.c1, mode=mode, combine=group.combine(rank), rank=rank,
                                       size=size)
            row = RowParallelLinear(case.w2, chunk=case.c2, mode=mode, combine=group.combine(rank), rank=rank,
                                    size=size)
            x = case.x.clone().requires_grad_(True)
            y = row(torch.relu(col(x)))  # relu: exact, the same bits whatever the slice
            y.backward(case.gy)
            out = results[rank]
            out["y"], out["x.grad"] = y.detach(), x.grad  # type: ignore[assignment]
            for layer, name in ((col, "col"), (row, "row")):
                for j, p in layer.chunks.items():
                    out[f"{name}.{j}"] = p.grad
        except BaseException as err:  # reported by the caller; the barrier is broken
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    merged: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(results):
        for key, value in res.items():
            if key in merged:  # replicated: every rank must hold the same bits
                assert torch.equal(merged[key], value), f"rank {rank} disagrees on {key}"
            merged[key] = value
    return merged


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose bits differ (all names must be present in both)."""
    assert sorted(a) == sorted(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 24), d_in=st.integers(1, 40), n1=st.sampled_from([4, 8]), c1=st.integers(1, 12),
       per_c2=st.sampled_from([1, 2, 4]), d_out=st.integers(1, 24), seed=st.integers(0, 1000))
def test_column_and_row_parallel_give_the_bits_of_tp1_forward_and_backward(
        rows: int, d_in: int, n1: int, c1: int, per_c2: int, d_out: int, seed: int) -> None:
    # the row layer's chunk: a divisor of the hidden size leaving a multiple of 4 chunks (T up to 4)
    hidden = n1 * c1
    c2 = hidden // (4 * per_c2) if hidden % (4 * per_c2) == 0 else hidden // 4
    case = _case(rows, d_in, n1, c1, c2, d_out, seed)
    reference = _run(case, 1, "invariant")
    for size in (2, 4):
        assert _equal(reference, _run(case, size, "invariant")) == [], size


def test_tp1_is_the_plain_linear_up_to_rounding() -> None:
    """The chunked tree is a linear layer: T = 1's y is x W1^T relu'd through W2, within float rounding."""
    case = _case(8, 32, 8, 4, 8, 16, 0)
    y = _run(case, 1, "invariant")["y"]
    torch.testing.assert_close(y, torch.relu(case.x @ case.w1.T) @ case.w2.T)


def test_plain_tensor_parallelism_differs_from_tp1() -> None:
    """The negative control: one product per rank and an all-reduce change bits with T (the invariant
    layers on the same cases do not: the test above)."""
    differ = set()
    for seed in range(4):
        case = _case(16, 64, 8, 16, 32, 64, seed)  # an inner dimension of 128
        reference = _run(case, 1, "plain")
        differ |= set(_equal(reference, _run(case, 2, "plain")))
        assert _equal(_run(case, 1, "invariant"), _run(case, 2, "invariant")) == []
    # the row layer's output (its sum over the inner dimension) and so everything upstream of it
    assert "y" in differ and "x.grad" in differ, differ


def test_usage_errors() -> None:
    w = torch.zeros(8, 6)
    with pytest.raises(UsageError, match="chunk size 3 must divide"):
        ColumnParallelLinear(w, chunk=3, combine=lambda t: t, rank=0, size=1)
    with pytest.raises(UsageError, match="3 chunks do not split evenly over 2"):
        RowParallelLinear(w, chunk=2, combine=lambda t: t, rank=0, size=2)  # 3 chunks on 2 ranks
    with pytest.raises(UsageError, match="power-of-two"):
        owned_chunks(6, 3, 0)
    with pytest.raises(UsageError, match="mode"):
        ColumnParallelLinear(w, chunk=2, mode="ring")
    with pytest.raises(UsageError, match="needs the rank"):
        ColumnParallelLinear(w, chunk=2, combine=lambda t: t)
    assert list(owned_chunks(8, 4, 2)) == [4, 5]
    with pytest.raises(UsageError, match="rank 4"):
        owned_chunks(8, 4, 4)
    layer = RowParallelLinear(w, chunk=2, combine=lambda t: t, rank=0, size=1)
    assert list(layer.chunks) == ["0", "1", "2"] and torch.equal(layer.chunks["1"], w[:, 2:4])
