"""The reference trainer at several parallel layouts, one after the other, in the processes of ONE torchrun job.

    torchrun --standalone --nproc-per-node N layouts.py "ARGS" ["ARGS" ...]

Each ARGS is the trainer's argument list for one layout (`python -m detrace.workload.train ARGS`). Before each,
rank 0 prints `layout ARGS`; then the trainer prints its lines as a job of its own would. A job of its own per
layout costs a launcher and N interpreters that import torch each time: here they are paid once.

ARGS of `--parallel none` (the single-process run) runs on rank 0 alone, before the others join the group.
Between layouts the process group stays up: the trainer's teardown would destroy it, and a group re-created
in the same process from torchrun's store would meet the keys the first one left there.
"""

from __future__ import annotations

import os
import shlex
import sys

import torch.distributed as dist

from detrace._exit import leave
from detrace.workload import layouts, train


def _keep_the_group(layout: layouts.Layout, *, completed: bool) -> None:
    """The trainer's teardown, less the group's destruction: no rank starts the next layout while a peer still
    waits on its last collective."""
    if completed and layout.mesh is not None and dist.is_initialized():
        dist.barrier()


def main(runs: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    layouts.teardown = _keep_the_group  # type: ignore[assignment]
    for args in runs:
        argv = shlex.split(args)
        single = "--parallel" not in argv or argv[argv.index("--parallel") + 1] == "none"
        if single and rank != 0:
            continue
        if rank == 0:
            print(f"layout {args}", flush=True)
        code = train.main(argv)
        if code:
            return code
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
