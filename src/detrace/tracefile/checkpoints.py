"""The checkpoint saves and loads a traced run made by itself: `torch.save` / `torch.load`, safetensors files and
`torch.distributed.checkpoint`, whoever called them (the script, HF `Trainer`, Lightning, torchtitan), each with
the optimizer steps completed when it ran and the files it named. The tracer (detrace.record.rungs.checkpoints)
appends one JSON line per call as it returns, so a process that is killed right after keeps what it saved.

It also appends where a save went afterwards, and the reader follows it: a "rename" line (the saved file or folder,
or one holding it, was renamed: `paths` are where the saves' `from` paths are now), a "landed" line (the bytes of
the process's save into memory number `memory` were found in the file of `paths`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from detrace.errors import TraceError
from detrace.tracefile.layout import CHECKPOINT_LOG_GLOB, read_json_lines

OPS = ("save", "load")


@dataclass(frozen=True, kw_only=True)
class CheckpointIO:
    """One checkpoint save or load of a traced process."""

    op: str
    """"save" or "load"."""
    api: str
    """What was called: "torch.save", "torch.load", "safetensors.save_file", "dcp.save", ..."""
    completed: int
    """Optimizer steps completed when it ran (global steps: a resumed run counts on from its checkpoint)."""
    paths: tuple[str, ...]
    """The files or directories it named (none for a file object without a name, such as a buffer)."""
    pid: int
    control: str | None = None
    """The negative control applied to what this load returned (check-resume --native), or None."""
    rng: tuple[tuple[str, tuple[str | int, ...]], ...] = ()
    """A save's RNG states: (kind, key path) for each state that an RNG getter returned in what it wrote (kind:
    "torch", "cuda", "cuda-all", "python", "numpy"; the key path: dict keys and list indices from the top)."""
    in_memory: bool = False
    """A save into memory (`torch.save` into a buffer): `paths` are the files its bytes were found in afterwards,
    none when no file the tracer looked in holds them (they were uploaded, or written elsewhere)."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, not {self.op!r}")
        if self.completed < 0:
            raise ValueError(f"completed must be >= 0, not {self.completed}")


def read_checkpoint_log(run: Path) -> list[CheckpointIO]:
    """Every checkpoint save and load of the run's processes, in each process's order (processes by pid); a save
    names the files it ended up in (renamed, or written from memory)."""
    found: list[CheckpointIO] = []
    memory: dict[tuple[int, int], int] = {}
    """Where each process's saves into memory are in `found`, by (pid, number)."""
    for item in read_json_lines(run, CHECKPOINT_LOG_GLOB, lambda item: item, "a checkpoint record"):
        try:
            if item.get("op") == "rename":
                _renamed(found, int(item["pid"]), dict(zip(item["from"], item["paths"], strict=True)))
            elif item.get("op") == "landed":
                at = memory[(int(item["pid"]), int(item["memory"]))]
                found[at] = dataclasses.replace(found[at], paths=(*found[at].paths, *item["paths"]))
            else:
                if item.get("memory") is not None:
                    memory[(int(item["pid"]), int(item["memory"]))] = len(found)
                found.append(CheckpointIO(
                    op=item["op"], api=item["api"], completed=int(item["completed"]), paths=tuple(item["paths"]),
                    pid=int(item["pid"]), control=item.get("control"), in_memory=item.get("memory") is not None,
                    rng=tuple((str(kind), tuple(path)) for kind, path in item.get("rng", []))))
        except (ValueError, KeyError, TypeError) as err:
            raise TraceError(f"{run} holds a line that is not a checkpoint record ({err}): {item}") from err
    return found


def _renamed(found: list[CheckpointIO], pid: int, moved: dict[str, str]) -> None:
    """The saves of process `pid` that named a path of `moved` name where it went."""
    for at, io in enumerate(found):
        if io.op == "save" and io.pid == pid and any(path in moved for path in io.paths):
            found[at] = dataclasses.replace(io, paths=tuple(moved.get(path, path) for path in io.paths))
