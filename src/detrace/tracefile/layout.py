"""File names inside a run directory."""

from __future__ import annotations

from pathlib import Path

RUN_HEADER = "run.json"


def rank_path(run_dir: str | Path, rank: int) -> Path:
    """The append-only Arrow IPC file of one rank."""
    return Path(run_dir) / f"rank-{rank:05d}.arrow"


def footer_path(run_dir: str | Path, rank: int) -> Path:
    """The footer a rank writes when it closes cleanly; its absence means the rank ended early."""
    return Path(run_dir) / f"rank-{rank:05d}.json"


def run_header_path(run_dir: str | Path) -> Path:
    """The run header written by `detrace run` (command, world size, rung, windows, versions)."""
    return Path(run_dir) / RUN_HEADER
