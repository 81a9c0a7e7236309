"""The suite's guard for forked children (tests/conftest.py): a process group that an in-process test left to the
collector is collected in the parent before a fork, not in the child, where ~ProcessGroupGloo would wait for ever
on worker threads a fork does not copy (a DataLoader worker of test_streams hung so)."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path

import torch
import torch.distributed as dist


class _Cycle:
    """An object that refers to itself: only the collector frees it, as a DeviceMesh or a module may be."""


def test_a_fork_after_a_process_group_left_to_the_collector_does_not_hang(tmp_path: Path) -> None:
    gc.disable()  # no automatic collection before the fork: only the guard's
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        try:
            holder = _Cycle()
            holder.group, holder.me = dist.new_group([0]), holder  # type: ignore[attr-defined]
            dist.all_reduce(torch.ones(2), group=holder.group)  # type: ignore[attr-defined]
        finally:
            dist.destroy_process_group()
        del holder
        child = multiprocessing.get_context("fork").Process(target=gc.collect)
        child.start()
    finally:
        gc.enable()
    child.join(timeout=60)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung and child.exitcode == 0
