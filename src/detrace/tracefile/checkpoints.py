"""The checkpoint saves and loads a traced run made by itself: `torch.save` / `torch.load`, safetensors files and
`torch.distributed.checkpoint`, whoever called them (the script, HF `Trainer`, Lightning, torchtitan), each with
the optimizer steps completed when it ran and the files it named. The tracer (detrace.record.rungs.checkpoints)
appends one JSON line per call as it returns, so a process that is killed right after keeps what it saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, not {self.op!r}")
        if self.completed < 0:
            raise ValueError(f"completed must be >= 0, not {self.completed}")


def read_checkpoint_log(run: Path) -> list[CheckpointIO]:
    """Every checkpoint save and load of the run's processes, in each process's order (processes by pid)."""
    return read_json_lines(run, CHECKPOINT_LOG_GLOB, lambda item: CheckpointIO(
        op=item["op"], api=item["api"], completed=int(item["completed"]), paths=tuple(item["paths"]),
        pid=int(item["pid"]), control=item.get("control"),
        rng=tuple((str(kind), tuple(path)) for kind, path in item.get("rng", []))), "a checkpoint record")
