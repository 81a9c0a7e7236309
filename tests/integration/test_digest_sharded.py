"""A DTensor's fingerprint is its global tensor's, computed from the shards (detrace.digest.sharded): the keyed sum
in process over simulated shards, and real gloo ranks with DTensors on 1-D and 2-D meshes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
from _ranks import spawn_ranks

from detrace import fingerprint
from detrace._compat import dtensor_local_box
from detrace.digest.scheme import SCHEME, SCHEME2, Fingerprint, add, header, signed
from detrace.digest.sharded import WORD, _join, _padding, _runs, _sum_at, part_of
from detrace.investigate.check_topology import Mesh, Mismatch, _records
from detrace.parallel.layout import Layout
from detrace.tracefile import ARROW_SCHEMA, RankWriter

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


def _as_check_topology_reads(out: Path, records: list[Fingerprint]) -> str | Mismatch:
    """The ranks' records of one parameter (as the tracer writes them: `part_of`, or the local tensor's
    fingerprint where it has none), written as the traces of an fsdp run and read back by check-topology: the global
    digest it compares (hex), or the disagreement it reports."""
    for rank, fp in enumerate(records):
        row = {"seq": 0, "step": 0, "rung": "semantic", "phase": "optimizer", "module": None, "name": "head.weight",
               "occurrence": 0, "event": 0, "role": "param", "index": 0, "shape": list(fp.shape), "dtype": fp.dtype,
               "numel": fp.numel, "digest": fp.digest, "chunks": None, "value": None, "collectives": 0,
               "group": None, "group_seq": None, "peer": None, "extra": None}
        writer = RankWriter(out, rank, header={"world_size": len(records), "rung": "semantic", "synthetic": True,
                                               "fingerprint": fp.scheme})
        writer.add_batch(pa.RecordBatch.from_pylist([row], schema=ARROW_SCHEMA))
        writer.close()
    merged, mismatch, _ = _records(out, Mesh.of(Layout.parse(f"fsdp{len(records)}")), grad_norm=False, label="x")
    return mismatch if mismatch is not None else merged[(0, "param", "head.weight")]


def _records_of_ranks(whole: torch.Tensor, mesh_shape: tuple[int, ...], placements: list[Any], scheme: str
                      ) -> list[Fingerprint]:
    """What the tracer records of `whole` sharded as torch shards it (`torch.chunk`'s sizes: an uneven split leaves
    the last ranks empty), rank by rank in this process on a fake process group (no collective runs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(mesh_shape)
    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            local = distribute_tensor(whole, mesh, placements).to_local()  # the fake scatter leaves its bits unset
            box, offset = dtensor_local_box(DTensor.from_local(local, mesh, placements, run_check=False,
                                                               shape=whole.shape, stride=whole.stride()))
            local = whole[tuple(slice(o, o + n) for o, n in zip(offset, box, strict=True))].clone()
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=whole.shape,
                                    stride=whole.stride())
            out.append(part_of(dt, scheme) or fingerprint(local, scheme=scheme))
        finally:
            dist.destroy_process_group()
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("rows", "mesh_shape"), [(1, (2,)), (3, (2,)), (3, (4,)), (2, (4,)), (1, (4,))])
def test_the_records_of_an_uneven_shard_add_up_to_the_global_fingerprint(tmp_path: Path, scheme: str, rows: int,
                                                                          mesh_shape: tuple[int, ...]) -> None:
    """fully_shard of an nn.Linear(8, rows) head: a [1, 8] weight over 2 ranks leaves rank 1 an empty shard and
    rank 0 the whole tensor (recorded whole, as its fingerprint is the global one); check-topology read that as a
    shard missing ("its ranks' distinct shards hold 0 of its 8 elements")."""
    from torch.distributed.tensor import Shard

    whole = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
    records = _records_of_ranks(whole, mesh_shape, [Shard(0)], scheme)
    assert _as_check_topology_reads(tmp_path / "run", records) == fingerprint(whole, scheme=scheme).hex
    # the test can fail: rank 0 holding other bits gives another digest
    wrong = _records_of_ranks(whole + 1, mesh_shape, [Shard(0)], scheme)[:1] + records[1:]
    assert _as_check_topology_reads(tmp_path / "wrong", wrong) != fingerprint(whole, scheme=scheme).hex


def test_replicas_of_the_whole_shard_that_disagree_are_named(tmp_path: Path) -> None:
    """HSDP (a replicated dimension outside the sharded one): every replica's rank 0 holds the whole [1, 8] weight,
    and they must agree."""
    from torch.distributed.tensor import Replicate, Shard

    whole = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    records = _records_of_ranks(whole, (2, 2), [Replicate(), Shard(0)], SCHEME)
    assert [fp.numel for fp in records] == [8, 0, 8, 0]
    assert _as_check_topology_reads(tmp_path / "run", records) == fingerprint(whole).hex
    records[2] = fingerprint(whole + 1)
    mismatch = _as_check_topology_reads(tmp_path / "replicas", records)
    assert isinstance(mismatch, Mismatch) and (mismatch.kind, mismatch.name) == ("ranks", "param head.weight")
    assert mismatch.detail == f"rank 0 {fingerprint(whole).hex}, rank 2 {fingerprint(whole + 1).hex}"


# ----------------------------------------------------------------------------------------------------------
# real ranks: DTensors on gloo, against the fingerprint of the whole tensor (which every rank builds from one seed)


def _parts(dt: torch.Tensor, whole: torch.Tensor, want: Fingerprint, out: Path) -> bool | None:
    """Whether the ranks' records (what the tracer records of a sharded DTensor, no collective: its `part_of`, or
    the whole tensor's fingerprint on a rank that holds every element of an uneven shard) complete to the global
    fingerprint `want` as check-topology adds them up (on every rank, in its own folder `out`); None where a rank has
    no part (a replicated DTensor, runs that split a word)."""
    part = part_of(dt, want.scheme)
    held = part or fingerprint(dt.to_local(), scheme=want.scheme)
    mine = torch.tensor([int(part is not None or held.numel == whole.numel()), signed(held.digest), held.numel])
    every = torch.empty(dist.get_world_size() * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine)
    rows = every.view(-1, 3).tolist()
    if not all(flag for flag, _, _ in rows) or not any(numel < whole.numel() for _, _, numel in rows):
        return None
    records = [Fingerprint(digest % (1 << 64), want.dtype, want.shape, numel, scheme=want.scheme)
               for _, digest, numel in rows]
    return _as_check_topology_reads(out, records) == want.hex


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
                  torch.randint(0, 9, (6, 10), generator=g), torch.randn(9, 7, generator=g).to(torch.bfloat16),
                  # uneven shards on dimension 0 that leave ranks empty: a [1, 8] head over 2 or 4 ranks is rank 0's
                  torch.randn(1, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(2, 8, generator=g)]
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
                        reads = Path(out, f"rank{rank}-reads", str(len(results)))
                        results.append((str(placements), tuple(whole.shape), scheme, got.hex == want.hex,
                                        got.shape == want.shape, not gathered, _parts(dt, whole, want, reads)))
        # a fully_shard model: parameters_fingerprint is the unsharded model's, on every rank
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(5, 33), torch.nn.Linear(33, 3))
        plain = parameters_fingerprint(model)
        fully_shard(model[0], mesh=meshes[0])
        fully_shard(model, mesh=meshes[0])
        results.append(("fsdp", (), "", parameters_fingerprint(model) == plain, True, True, None))
        # a model with an nn.Linear(8, 1) head: its [1, 8] weight and [1] bias are all on rank 0
        head = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, 1))
        wholes = [p.detach().clone() for p in head.parameters()]
        fully_shard(head, mesh=meshes[0])
        for i, (param, whole) in enumerate(zip(head.parameters(), wholes, strict=True)):
            want = fingerprint(whole)
            results.append(("fsdp head", tuple(whole.shape), want.scheme, fingerprint(param).hex == want.hex, True,
                            True, _parts(param, whole, want, Path(out, f"rank{rank}-reads", f"head{i}"))))
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
    # fully_shard of a model with an nn.Linear(8, 1) head: each parameter's records add up to its fingerprint
    assert [(equal, parts) for p, _, _, equal, _, _, parts in rows if p == "fsdp head"] == [(True, True)] * 4
