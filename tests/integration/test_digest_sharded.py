"""A DTensor's fingerprint is its global tensor's, computed from the shards (detrace.digest.sharded): the keyed sum
in process over simulated shards, and real gloo ranks with DTensors on 1-D and 2-D meshes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _ranks import spawn_ranks

from detrace import fingerprint
from detrace.digest.scheme import SCHEME, SCHEME2, Fingerprint, add, header, signed
from detrace.digest.sharded import WORD, _join, _padding, _runs, _sum_at, part_of, whole_digest

SCHEMES = (SCHEME, SCHEME2)


def _global_of(parts: list[tuple[torch.Tensor, tuple[int, ...]]], whole: torch.Tensor, scheme: str) -> int:
    """The digest of `whole` from its boxes (local tensor, offset), summed as the ranks' partial sums are."""
    size = whole.element_size()
    low = high = 0
    for local, offset in parts:
        starts, run = _runs(tuple(whole.shape), tuple(local.shape), offset)
        assert not (starts * size % WORD).any()
        data = local.contiguous().reshape(-1).view(torch.uint8)
        data = torch.cat([data, torch.zeros(-data.numel() % WORD, dtype=torch.uint8)])
        part = _sum_at(data.view(torch.int64), starts * size // WORD, -(-run * size // WORD), scheme).tolist()
        low, high = low + part[0], high + part[1]
    nbytes = whole.numel() * size
    digest = add(_join(low, high, scheme), _padding(nbytes, torch.device("cpu"), scheme), scheme)
    return add(digest, header(str(whole.dtype).removeprefix("torch."), tuple(whole.shape), scheme), scheme)


def _boxes(whole: torch.Tensor, splits: dict[int, list[int]]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """`whole` cut along each dimension of `splits` at those sizes: the boxes and their offsets."""
    boxes = [(whole, (0,) * whole.dim())]
    for dim, sizes in splits.items():
        cut = []
        for box, offset in boxes:
            start = 0
            for piece in box.split(sizes, dim=dim):
                cut.append((piece, tuple(o + start if d == dim else o for d, o in enumerate(offset))))
                start += piece.shape[dim]
        boxes = cut
    return boxes


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_sum_over_boxes_is_the_fingerprint_of_the_whole(scheme: str) -> None:
    g = torch.Generator().manual_seed(0)
    # rows across the 4096-byte rows of the scheme (float32 [1500, 6]: 36 000 bytes), cut as Shard(0) even and
    # uneven, Shard(1), both (a 2-D mesh), a 3-D tensor on its middle dimension, and the last run's word half full
    cases = [(torch.randn(1500, 6, generator=g), {0: [750, 750]}),
             (torch.randn(1500, 6, generator=g), {0: [700, 500, 300]}),
             (torch.randn(1500, 6, generator=g), {1: [2, 4]}),
             (torch.randn(1500, 6, generator=g), {0: [1000, 500], 1: [4, 2]}),
             (torch.randn(7, 300, 4, generator=g), {1: [100, 100, 100]}),
             (torch.randn(2049, generator=g), {0: [1024, 1025]}),  # 8196 bytes: the last word holds one element
             (torch.randint(-100, 100, (64, 40), dtype=torch.int8, generator=g), {1: [16, 24]}),
             (torch.randn(3, 0, 2, generator=g), {0: [2, 1]}),
             (torch.tensor(3.5), {})]
    for whole, splits in cases:
        assert _global_of(_boxes(whole, splits), whole, scheme) == fingerprint(whole, scheme=scheme).digest, splits
    # the test can fail: two boxes swapped (each at the other's offset) give another digest
    whole = cases[0][0]
    (a, at_a), (b, at_b) = _boxes(whole, {0: [750, 750]})
    assert _global_of([(a, at_b), (b, at_a)], whole, scheme) != fingerprint(whole, scheme=scheme).digest


def test_the_runs_of_a_box_in_c_order() -> None:
    starts, run = _runs((4, 6, 5), (2, 3, 5), (1, 2, 0))  # rows 1-2, columns 2-4, whole last dimension
    assert run == 15 and starts.tolist() == [1 * 30 + 2 * 5, 2 * 30 + 2 * 5]
    starts, run = _runs((4, 6), (4, 2), (0, 3))
    assert run == 2 and starts.tolist() == [3, 9, 15, 21]
    starts, run = _runs((), (), ())  # a scalar: one run of one element
    assert run == 1 and starts.tolist() == [0]


# ----------------------------------------------------------------------------------------------------------
# real ranks: DTensors on gloo, against the fingerprint of the whole tensor (which every rank builds from one seed)


def _parts(dt: torch.Tensor, whole: torch.Tensor, want: Fingerprint) -> bool | None:
    """Whether the ranks' `part_of` digests (what the tracer records of a sharded DTensor, no collective) complete
    to the global fingerprint `want` (`whole_digest` over the distinct shards, as check-topology adds them); None
    where a rank has no part (a replicated DTensor, runs that split a word)."""
    part = part_of(dt, want.scheme)
    mine = torch.tensor([0, 0, 0] if part is None else [1, signed(part.digest), part.numel])
    every = torch.empty(dist.get_world_size() * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(-1, 3).tolist()
    if not all(flag for flag, _, _ in rows):
        return None
    distinct = {digest % (1 << 64): numel for _, digest, numel in rows}  # a replica's part counted once
    assert sum(distinct.values()) == whole.numel()
    return whole_digest(list(distinct), whole.dtype, tuple(whole.shape), want.scheme) == want.digest


def _check_rank(rank: int, world: int, out: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from detrace.parallel import parameters_fingerprint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gathered: list[bool] = []
    full_tensor = DTensor.full_tensor

    def counted(self: DTensor, **kwargs: object) -> torch.Tensor:
        gathered.append(True)
        return full_tensor(self, **kwargs)  # type: ignore[arg-type]

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    try:
        g = torch.Generator().manual_seed(0)
        wholes = [torch.randn(37, 64, generator=g), torch.randn(8, 1024, generator=g).to(torch.bfloat16),
                  torch.randint(0, 9, (6, 10), generator=g), torch.randn(9, 7, generator=g).to(torch.bfloat16)]
        meshes = [init_device_mesh("cpu", (world,))]
        if world == 4:
            meshes.append(init_device_mesh("cpu", (2, 2)))
        results = []
        for mesh in meshes:
            layouts = [[Shard(0)], [Shard(1)], [Replicate()]] if mesh.ndim == 1 else \
                [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(0)], [Shard(0), Shard(0)]]
            for placements in layouts:
                for whole in wholes:
                    dt = distribute_tensor(whole, mesh, placements)
                    for scheme in ("fp1", "fp2"):
                        gathered.clear()
                        got = fingerprint(dt, scheme=scheme)
                        want = fingerprint(whole, scheme=scheme)
                        results.append((str(placements), tuple(whole.shape), scheme, got.hex == want.hex,
                                        got.shape == want.shape, not gathered, _parts(dt, whole, want)))
        # a fully_shard model: parameters_fingerprint is the unsharded model's, on every rank
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(5, 33), torch.nn.Linear(33, 3))
        plain = parameters_fingerprint(model)
        fully_shard(model[0], mesh=meshes[0])
        fully_shard(model, mesh=meshes[0])
        results.append(("fsdp", (), "", parameters_fingerprint(model) == plain, True, True, None))
        Path(out, f"rank{rank}.txt").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_dtensors_fingerprint_is_its_global_tensors_on_every_rank(tmp_path: Path, world: int) -> None:
    spawn_ranks(_check_rank, (world, str(tmp_path)), nprocs=world, timeout=240)
    rows = json.loads((tmp_path / "rank0.txt").read_text())
    for rank in range(1, world):  # the same verdicts on every rank
        assert (tmp_path / f"rank{rank}.txt").read_text() == (tmp_path / "rank0.txt").read_text()
    assert all(equal and shape for _, _, _, equal, shape, _, _ in rows), [r for r in rows if not r[3]]
    # computed from the shards, not gathered: every float32 and int64 case; the bfloat16 [9, 7] sharded on
    # dimension 1 (runs of an odd number of 2-byte elements split words) falls back to gathering
    by_case = {(p, tuple(s)): sums for p, s, _, _, _, sums, _ in rows}
    # what the tracer records: each rank's part of a sharded DTensor's fingerprint, completed offline to the global
    # one; a DTensor no placement shards is recorded whole instead (no parts)
    assert all(parts for p, s, _, _, _, sums, parts in rows if sums and "Shard" in p and s != [9, 7])
    assert all(parts is None for p, _, _, _, _, _, parts in rows if p == "[Replicate()]")
    assert all(by_case[(p, s)] for p, s in by_case if s in ((37, 64), (6, 10), (8, 1024), ()))
    assert not by_case[("[Shard(dim=1)]", (9, 7))]
