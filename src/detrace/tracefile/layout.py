"""File names inside a run directory, and the one rule for every directory detrace writes into.

Nothing else spells these names: a module that looks for rank files, captures or the report asks here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from detrace.errors import TraceError, UsageError

T = TypeVar("T")

RUNS_DIR = "detrace-runs"
"""Where every command's default output directory goes, in the working directory (one folder to clean)."""
NATIVE_CHECK_LOCK = "native-check.lock"
"""In the working directory's RUNS_DIR: held by the check-resume --native that moves checkpoints there (naming its
OUT); left behind, unlocked, by one that was killed (detrace.investigate.native_resume)."""
LATEST = "latest"
"""`detrace-runs/<kind>-latest`: a link to the newest default output of a kind that completed."""
RUN_HEADER = "run.json"
REPORT_FILE = "report.html"
"""The HTML report `detrace report` writes into a run or locate directory by default."""
ABLATE_FILE = "ablate.json"
"""`detrace ablate`'s result (detrace.ablate/1) in its output directory, which `detrace report` draws."""
CAPTURE_DIR = "capture"
"""Subdirectory of a run that holds the kernel rung's captures."""
RANK_GLOB = "rank-*.arrow"
"""The rank files of a run, as a pattern for messages."""
CHECKPOINT_LOG_GLOB = "checkpoints-*.jsonl"
"""The checkpoint saves and loads of each traced process of a run (JSON lines: detrace.tracefile.checkpoints)."""
STATE_PARTS_GLOB = "state-*.jsonl"
"""The training state, part by part, of each traced process at check-resume's stop points (JSON lines:
detrace.tracefile.state_parts)."""
_RANK_FILE = re.compile(r"^rank-(\d{5})\.arrow$")
_RANK_FOOTER = re.compile(r"^rank-(\d{5})\.json$")
_AUX_FILE = re.compile(r"^aux-(\d+)\.(arrow|json)$")
_UNTRACED_FILE = re.compile(r"^untraced-(\d+)\.json$")
_CAPTURE_FILE = re.compile(r"^rank-(\d+)-seq(\d+)\.safetensors$")


def checkpoint_log_path(run_dir: str | Path, pid: int) -> Path:
    """The checkpoint saves and loads of one traced process (see CHECKPOINT_LOG_GLOB)."""
    return Path(run_dir) / f"checkpoints-{pid}.jsonl"


def state_parts_path(run_dir: str | Path, pid: int) -> Path:
    """The state, part by part, of one traced process at check-resume's stop points (see STATE_PARTS_GLOB)."""
    return Path(run_dir) / f"state-{pid}.jsonl"


def read_json_lines(run: Path, pattern: str, record: Callable[[dict[str, Any]], T], what: str) -> list[T]:
    """The records of the run's JSON-lines side files matching `pattern` (one file per process, by pid), each line
    made into a record by `record`; a line that is not one is a TraceError naming the file and line."""
    found = []
    for path in sorted(run.glob(pattern)):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                found.append(record(json.loads(line)))
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{path}, line {number}, is not {what} ({err})") from err
    return found


def rank_path(run_dir: str | Path, rank: int) -> Path:
    """The append-only Arrow IPC file of one rank."""
    return Path(run_dir) / f"rank-{rank:05d}.arrow"


def rank_of(path: Path) -> int | None:
    """The rank whose trace file `path` is (`rank_path`), or None for another file (an auxiliary trace)."""
    match = _RANK_FILE.match(path.name)
    return int(match.group(1)) if match else None


def footer_path(run_dir: str | Path, rank: int) -> Path:
    """The footer a rank writes when it closes cleanly; its absence means the rank ended early."""
    return Path(run_dir) / f"rank-{rank:05d}.json"


def aux_path(run_dir: str | Path, pid: int) -> Path:
    """The trace of a process that is not a rank of the job (an eval subprocess, a data preprocessor that a
    recording process started): it never shares a rank's file, and diff and certify of ranks do not read it."""
    return Path(run_dir) / f"aux-{pid}.arrow"


def aux_footer_path(run_dir: str | Path, pid: int) -> Path:
    """The footer an auxiliary process writes when it closes cleanly (see `footer_path`)."""
    return Path(run_dir) / f"aux-{pid}.json"


def aux_trace_paths(run_dir: str | Path) -> list[Path]:
    """The auxiliary traces a run directory holds (`aux_path`), by pid."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _AUX_FILE.match(p.name))
             and m.group(2) == "arrow"]
    return [p for _, p in sorted(found)]


def untraced_path(run_dir: str | Path, pid: int) -> Path:
    """The note a process of CMD leaves when its tracer did not start (its pid and why), which the launcher folds
    into run.json's `untraced` when CMD ends."""
    return Path(run_dir) / f"untraced-{pid}.json"


def untraced_paths(run_dir: str | Path) -> list[Path]:
    """The notes of `untraced_path` a run directory holds, by pid."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _UNTRACED_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def run_header_path(run_dir: str | Path) -> Path:
    """The run header written by `detrace run` (command, world size, rung, windows, versions)."""
    return Path(run_dir) / RUN_HEADER


def require_regular(path: Path, what: str) -> None:
    """Refuse a trace file that is not a regular file (a FIFO would block its reader forever, a device never
    ends); FileNotFoundError passes through, for the caller to say what a missing file means."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise TraceError(f"{what} {path} is not a regular file (a FIFO, a device or a directory); detrace reads "
                         "traces only from regular files")


def rank_trace_paths(run_dir: str | Path) -> dict[int, Path]:
    """The rank files a run directory holds, by rank (none when it is not a directory); OSError passes through."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return {}
    found = {int(m.group(1)): p for p in run_dir.iterdir() if (m := _RANK_FILE.match(p.name))}
    return dict(sorted(found.items()))


def capture_path(run_dir: str | Path, rank: int, seq: int) -> Path:
    """Where the kernel rung saves the call whose first record has this seq, on this rank."""
    return Path(run_dir) / CAPTURE_DIR / f"rank-{rank:05d}-seq{seq:08d}.safetensors"


def capture_paths(run_dir: str | Path) -> list[tuple[int, int, Path]]:
    """Every capture file of a run directory as (rank, seq, path), by rank then seq."""
    folder = Path(run_dir) / CAPTURE_DIR
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), int(m.group(2)), p) for p in folder.iterdir()
                  if (m := _CAPTURE_FILE.match(p.name)))


def trace_files(run_dir: str | Path) -> list[Path]:
    """What a traced run wrote into its directory: rank files, footers, auxiliary traces, a run.json of detrace's,
    capture files, checkpoint logs, state parts, notes of processes whose tracer did not start (nothing else: a
    user's own files there, `capture/` included, are never detrace's to remove)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if (p.name == RUN_HEADER and is_run_header(p))
             or _RANK_FILE.match(p.name) or _RANK_FOOTER.match(p.name) or _AUX_FILE.match(p.name)
             or (p.match(CHECKPOINT_LOG_GLOB) and not p.is_dir())
             or (p.match(STATE_PARTS_GLOB) and not p.is_dir()) or _UNTRACED_FILE.match(p.name)]
    captures = run_dir / CAPTURE_DIR
    if captures.is_dir() and not captures.is_symlink():
        found += [p for p in captures.iterdir() if _CAPTURE_FILE.match(p.name) and not p.is_dir()]
    return found


def is_run_header(path: Path) -> bool:
    """Whether `path` is a run.json that detrace wrote (a JSON object whose schema is detrace's)."""
    try:
        require_regular(path, "run header")
        with path.open("rb") as handle:
            raw = json.loads(handle.read(1 << 20))
    except (OSError, ValueError, TraceError):
        return False
    return isinstance(raw, dict) and str(raw.get("schema", "")).startswith("detrace.")


def default_out(kind: str, base: Path | None = None) -> Path:
    """A fresh `detrace-runs/<kind>-<timestamp>` under `base` (the working directory by default)."""
    base = (base or Path.cwd()) / RUNS_DIR
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = base / f"{kind}-{stamp}", 1
    while out.exists():
        n += 1
        out = base / f"{kind}-{stamp}-{n}"
    return out


def link_latest(out: Path, kind: str) -> Path | None:
    """Point `<out's folder>/<kind>-latest` at `out` (a default output that completed); the link, or None where
    links cannot be made."""
    link = out.parent / f"{kind}-{LATEST}"
    try:
        tmp = out.parent / f".{link.name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a reader never finds the link missing
    except OSError:
        return None
    return link


def remove_empty(out: Path) -> None:
    """Remove `out` and the folders in it, where they hold nothing (a failed command's directory): never a file."""
    if not out.is_dir() or out.is_symlink():
        return
    for folder in sorted((p for p in out.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()
    with contextlib.suppress(OSError):
        out.rmdir()


def shown_path(path: Path, limit: int = 120) -> str:
    """A path for a sentence: whole when short, else its start and its end (a path may be 4096 bytes long)."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 2 :]}"


def prepare_out(out: Path, *, holds: Literal["trace", "runs"], force: bool | None = None,
                name: str = "output directory") -> Path:
    """Create the directory a command writes into, by one rule for every command.

    - A path that exists and is not a directory is refused.
    - `holds="trace"` (one run: `detrace run`): a directory that already holds a trace is refused; `force`
      removes that trace, and only it (the user's other files stay, in `capture/` too). Other files never stop a
      run, but a `run.json` that is not detrace's is refused even with `force` (the run would overwrite it).
      The launcher holds the directory's lock (tracefile.lock) before this: a live run's trace is never removed.
    - `holds="runs"` (many runs and their results: locate, check, check-resume, check-topology, recheck): a
      directory that is not empty is refused, so that two results never mix; `force` writes into it all the
      same (each run's own directory still obeys the trace rule).

    `force` None: the command offers no --force, and the refusal does not suggest it. `name` is how the user
    named the directory ("--out", "output directory"). Refusals of a trace are `TraceError`, the rest
    `UsageError`: both exit 2.
    """
    try:
        os.stat(out)
    except FileNotFoundError:
        pass
    except OSError as err:  # a name past NAME_MAX or PATH_MAX, a loop of links, a file where a folder should be
        raise UsageError(f"cannot write to {name} {shown_path(out)}: {err.strerror or err}") from None
    if out.exists() and not out.is_dir():
        raise UsageError(f"{name} {out} exists and is not a directory")
    hint = "; choose another directory" + ("" if force is None else " or pass --force")
    if holds == "trace":
        header = run_header_path(out)
        if header.is_symlink() or (header.exists() and not is_run_header(header)):
            raise TraceError(f"{header} is not a detrace run header, and a run writes its own there; move it or "
                             "choose another directory (--force replaces only a detrace trace)")
        existing = trace_files(out)
        if existing and not force:
            raise TraceError(f"{out} already holds a trace{hint}")
    else:
        existing = []
        if out.is_dir() and any(out.iterdir()) and not force:
            raise UsageError(f"{name} {out} is not empty{hint}")
    try:
        for path in existing:
            path.unlink()
        with contextlib.suppress(OSError):  # only when the captures were all it held
            (out / CAPTURE_DIR).rmdir()
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write to {name} {shown_path(out)}: {err.strerror or err}") from None
    return out
