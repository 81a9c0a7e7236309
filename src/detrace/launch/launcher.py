"""The zero-edit launcher behind `detrace run`: runs CMD with the tracer injected into every Python process.

`run_traced` refuses (or, with force, clears) a directory that already holds a trace, writes a preliminary
run.json (which also proves the directory writable), starts CMD in its own process group with DETRACE_TRACE
and the inject directory on PYTHONPATH, streams its output while keeping the last few KB, and completes
run.json from the ranks' headers when CMD ends. Commands that run CMD several times (check, check-resume,
locate, recheck, check-topology) give every run the same stdin: detrace's own, read once (`shared_stdin`).
It never raises for a nonzero exit: that is `returncode`.

CMD's whole process tree is killed (SIGKILL) on a timeout, on an exception in the launcher (Ctrl-C), and when
the launcher itself dies, even by SIGKILL: a watchdog process does it then (see `detrace.launch.watchdog`).
SIGTERM to the launcher is passed on to CMD's process group (a second one kills it), and run.json is finished
as "interrupted". CMD's stdout and stderr stay apart.

run.json's `status` is "finished", "timeout" or "interrupted"; `cut_short` says why the trace holds less than
CMD ran (a rank that never closed its trace, a full disk). When run.json itself cannot be finished (a full
disk), it is rewritten in place, where it needs no new block; the problem is returned, never raised.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from detrace.errors import CommandFailed, TraceError, UsageError, os_error_text
from detrace.launch import watchdog
from detrace.launch.failure import TracerFailed, refusal, tracer_failure
from detrace.record.config import ENV_VAR, RECORDING_VAR, TraceConfig
from detrace.tracefile.layout import (
    aux_trace_paths,
    footer_path,
    prepare_out,
    rank_trace_paths,
    run_header_path,
    untraced_paths,
)
from detrace.tracefile.lock import writing
from detrace.tracefile.metadata import RunHeader, load_json
from detrace.tracefile.reader import iter_batches, load_footer, nothing_recorded
from detrace.tracefile.schema import SCHEMA_VERSION
from detrace.tracefile.writer import write_json_atomic

TAIL_BYTES = 4096
"""How much of CMD's combined output `LaunchResult.output_tail` keeps."""
STDIN_WAIT = 1.0
"""Seconds to wait for a pipe on detrace's stdin to hold data (or be closed) before every run gets none."""


@dataclass(frozen=True)
class LaunchResult:
    """What happened to a traced command."""

    returncode: int
    """CMD's exit status (negative: killed by that signal)."""
    out: Path
    """The run directory."""
    command: tuple[str, ...]
    elapsed: float
    """Wall-clock seconds CMD ran."""
    output_tail: str
    """The last ~4 KB of CMD's combined stdout and stderr."""
    cut_short: str | None = None
    """Why the trace holds less than CMD ran (one sentence), or None."""
    interrupted: bool = False
    """The launcher was sent SIGTERM and passed it on to CMD."""


Launcher = Callable[..., LaunchResult]
"""What runs CMD traced, with `run_traced`'s signature: `run_traced` itself, or (tests) a function that writes traces
of its own, so that the commands that launch CMD (check, check-resume, locate, recheck) have their verdicts tested in
process on traces with a known answer (the launch seam)."""


def _rank_headers(out: Path) -> dict[int, RunHeader]:
    headers = {}
    for rank, path in rank_trace_paths(out).items():
        try:
            stream = iter_batches(path)
        except (TraceError, ValueError):
            continue
        headers[rank] = stream.header
        stream.close()
    return headers


def _run_header(config: TraceConfig, out: Path, **facts: Any) -> dict[str, Any]:
    header: dict[str, Any] = {"schema": SCHEMA_VERSION, "command": list(config.command or ()), "rung": config.rung,
                              "windows": config.windows(), "ranks": config.rank_window.spec, "world_size": None}
    ranks = _rank_headers(out)
    if ranks:
        first = ranks[min(ranks)]
        sizes = [h.world_size for h in ranks.values() if h.world_size]
        header.update(world_size=max(sizes) if sizes else len(ranks), versions=first.versions,
                      determinism=first.determinism, traced_ranks=sorted(ranks), fingerprint=first.fingerprint)
    spans = [span for rank in ranks if (span := _steps_run(out, rank)) is not None]
    if spans:  # the global steps the run covered: from its first rank's first step to its last rank's last
        header["steps"] = {"first": min(first for first, _ in spans), "last": max(last for _, last in spans)}
    warned = _warnings(out, ranks)
    if warned:  # the integrations' warnings to the user, which a verdict repeats next to a divergence
        header["warnings"] = warned
    aux = aux_trace_paths(out)
    if aux:  # processes that are not ranks (an eval subprocess, say) traced apart; diff and certify skip them
        header["aux"] = [path.name for path in aux]
    untraced = _untraced(out)
    if untraced:
        header["untraced"] = untraced
    header.update(facts)
    return header


def _warnings(out: Path, ranks: Iterable[int]) -> list[str]:
    """The warnings the ranks' footers hold (`detrace.record.warned`), each once, in rank order."""
    found: list[str] = []
    for rank in sorted(ranks):
        try:
            raw = load_json(footer_path(out, rank), "rank footer")
        except (TraceError, FileNotFoundError):
            continue
        said = raw.get("warnings") if isinstance(raw, dict) else None
        if isinstance(said, list):
            found += [text for text in said if isinstance(text, str) and text not in found]
    return found


def _untraced(out: Path) -> list[dict[str, Any]]:
    """The notes of the processes whose tracer did not start (`launch.inject.note_untraced`), by pid; a note that
    cannot be read still counts, without its reason."""
    notes = []
    for path in untraced_paths(out):
        try:
            note = json.loads(path.read_text())
            notes.append({"pid": int(note["pid"]), "reason": str(note["reason"])})
        except (OSError, ValueError, KeyError, TypeError):
            notes.append({"pid": int(path.stem.partition("-")[2]), "reason": "its note is unreadable"})
    return notes


def _steps_run(out: Path, rank: int) -> tuple[int, int] | None:
    """(first, last) global step of a rank that closed its trace; None while it runs or if it never closed."""
    try:
        footer = load_footer(footer_path(out, rank))
    except TraceError:
        return None
    if footer is None or footer.first_step is None or footer.last_step < 0:
        return None
    return footer.first_step, footer.last_step


def _unclosed(out: Path) -> list[int]:
    """The ranks whose file exists but whose footer does not: they never closed their trace."""
    return [rank for rank in rank_trace_paths(out) if not footer_path(out, rank).exists()]


def _finish(path: Path, header: dict[str, Any]) -> str | None:
    """Write the final run.json; on an OSError (a full disk) overwrite the old one in place, compactly, which needs
    no new block. Returns the problem in words, or None."""
    try:
        write_json_atomic(path, header)
        return None
    except OSError as err:
        problem = f"cannot finish {path}: {os_error_text(err, path.parent)}"
    try:
        with open(path, "r+") as handle:
            text = json.dumps(header, sort_keys=True, separators=(",", ":"))
            handle.write(text)
            handle.truncate(len(text.encode()))
    except OSError:
        problem += "; it still says the run is running"
    return problem


def _pump(stream: IO[bytes], tail: collections.deque[bytes], lock: threading.Lock, sink: IO[bytes] | None) -> None:
    # mypy, ignored below: Popen's pipes are io.BufferedReader, which has read1; IO[bytes] does not declare it
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        with lock:  # stdout's and stderr's pumps share the tail
            tail.append(chunk)
            while sum(map(len, tail)) - len(tail[0]) > TAIL_BYTES:
                tail.popleft()
        if sink is not None:
            sink.write(chunk)
            sink.flush()


@functools.cache
def shared_stdin() -> bytes | None:
    """detrace's own stdin, read once, for every run of CMD: a command that runs CMD several times must give each
    run the same input (else run 2 reads nothing and differs from run 1). None for a terminal, which every run
    reads from itself; b"" where there is no input (none, /dev/null, or a pipe with no data after STDIN_WAIT)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return b""
    if os.isatty(0):
        return None
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        ready, _, _ = select.select([0], [], [], STDIN_WAIT)
        if not ready:
            print(f"detrace: stdin is a pipe that gave no data in {STDIN_WAIT:g} s; every run of the command gets "
                  "an empty stdin", file=sys.stderr)
            return b""
    elif not stat.S_ISREG(mode):
        return b""
    chunks = []
    while chunk := os.read(0, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _feed(stream: IO[bytes], data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):  # CMD may exit or close stdin before reading it all
        stream.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        stream.close()


def _start_watchdog(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes] | None:
    """The watchdog of CMD's tree (see detrace/launch/watchdog.py, run isolated by its path: no site, no package
    import); None where it cannot be started (CMD then runs unwatched)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", watchdog.__file__, str(proc.pid)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def _release_watchdog(watchdog: subprocess.Popen[bytes] | None, *, kill: bool) -> None:
    """CMD ended: let the watchdog go (kill: have it kill CMD's whole tree first), and reap it."""
    if watchdog is None:
        return
    assert watchdog.stdin is not None
    with contextlib.suppress(OSError):
        if not kill:
            watchdog.stdin.write(b"x")
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=30)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _kill_group(proc: subprocess.Popen[bytes], watchdog: subprocess.Popen[bytes] | None) -> None:
    _release_watchdog(watchdog, kill=True)  # the whole tree, torchrun's workers in their own sessions included
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_traced(cmd: Sequence[str], out: str | Path, *, rung: str = "metrics",
               steps: str | Mapping[str, str] = "all", ranks: str = "all", max_numel: int | None = None,
               capture: str | None = None, force: bool = False, env: Mapping[str, str] | None = None,
               timeout: float | None = None, quiet: bool = False, share_stdin: bool = True,
               untraced_ok: bool = False) -> LaunchResult:
    """Run `cmd` traced into `out`. `env` adds variables to this process's environment for CMD. With
    `share_stdin`, CMD reads `shared_stdin()` (the same bytes in every run this process launches); without,
    it inherits detrace's stdin (a single run, which may stream it).

    Raises UsageError for bad options, TraceError for an output directory that cannot be used, CommandFailed
    when CMD cannot be started or runs past `timeout` (its whole process tree is killed), NothingRecorded when
    the tracer did not start in CMD and nothing was recorded, unless `untraced_ok` (`detrace run`, whose summary
    says so: a command that judges the run would judge nothing).
    """
    command = tuple(cmd)
    if not command:
        raise UsageError("no command to run; give it after '--', e.g. detrace run -- python train.py")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):  # nan would be no timeout at all
        raise UsageError(f"the timeout must be a positive, finite number of seconds, not {timeout!r}")
    out = Path(out).resolve()
    config = TraceConfig(out=out, rung=rung, steps=steps, ranks=ranks, max_numel=max_numel, capture=capture,
                         command=command, launched=True)
    with contextlib.suppress(OSError):  # the directory first, to hold its lock before anything in it is touched
        out.mkdir(parents=True, exist_ok=True)
    if not os.path.isdir(out):  # it cannot be made: prepare_out says why, in one sentence
        prepare_out(out, holds="trace", force=force)
    with writing(out):  # a live run's directory is never replaced, and a dead writer is told from a live one
        prepare_out(out, holds="trace", force=force)
        header_path = run_header_path(out)
        child_env = dict(os.environ)
        child_env.update(env or {})
        # The resume contract's DETRACE_CKPT_DIR (detrace.state.contract; a literal here, since that module imports
        # torch): run.json names it so that `detrace spikes` and `detrace ablate` find the run's checkpoints.
        ckpt_dir = child_env.get("DETRACE_CKPT_DIR")
        facts = {"checkpoint_dir": str(Path(ckpt_dir).resolve())} if ckpt_dir else {}
        try:
            write_json_atomic(header_path, _run_header(config, out, status="running", **facts))
        except OSError as err:
            raise TraceError(f"cannot write to output directory {out}: {os_error_text(err, out)}") from None

        from detrace.launch.inject import DIRECTORY

        child_env[ENV_VAR] = config.to_env()
        child_env.pop(RECORDING_VAR, None)  # CMD is the root of a new job, whatever this process records
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DIRECTORY), child_env.get("PYTHONPATH")]))
        given = shared_stdin() if share_stdin else None
        start = time.monotonic()
        try:
            proc = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=None if given is None else subprocess.PIPE if given else subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as err:
            # Nothing ran, so nothing was traced: the header that said "running" goes, and the directory stays usable.
            header_path.unlink(missing_ok=True)
            if isinstance(err, FileNotFoundError):
                raise CommandFailed(f"command not found: {command[0]}") from None
            if isinstance(err, PermissionError):
                raise CommandFailed(f"cannot execute {command[0]}: permission denied") from None
            raise CommandFailed(f"cannot start {command[0]}: {err.strerror or err}") from None
        watchdog = _start_watchdog(proc)
        if given:
            assert proc.stdin is not None
            # A thread: CMD may read its input only as it writes output, and a full pipe must not block the launcher.
            threading.Thread(target=_feed, args=(proc.stdin, given), daemon=True).start()
        tail: collections.deque[bytes] = collections.deque()
        lock = threading.Lock()
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [threading.Thread(target=_pump, args=(stream, tail, lock, None if quiet else sink), daemon=True)
                 for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
        for pump in pumps:
            pump.start()
        timed_out = False
        terms: list[int] = []
        with _forwarding_sigterm(proc, terms):
            try:
                proc.wait(timeout=timeout)
                _release_watchdog(watchdog, kill=False)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc, watchdog)
            except BaseException:
                _kill_group(proc, watchdog)
                _finish(header_path, _run_header(config, out, status="interrupted", returncode=proc.returncode,
                                                 elapsed=round(time.monotonic() - start, 3)))
                raise
            finally:
                for pump in pumps:
                    pump.join(timeout=5)
        elapsed = time.monotonic() - start
        status = "timeout" if timed_out else "interrupted" if terms else "finished"
        unclosed = _unclosed(out)
        cut_short = (f"rank{'s' * (len(unclosed) > 1)} {','.join(map(str, unclosed[:8]))} never closed "
                     f"{'their traces' if len(unclosed) > 1 else 'its trace'}" if unclosed else None)
        header = _run_header(config, out, status=status, returncode=proc.returncode, elapsed=round(elapsed, 3),
                             **facts)
        if cut_short:
            header["cut_short"] = cut_short
        problem = _finish(header_path, header)
        if problem is None:  # run.json holds the notes now
            for note in untraced_paths(out):
                note.unlink(missing_ok=True)
        cut_short = "; ".join(filter(None, [cut_short, problem])) or None
        if timed_out:
            raise CommandFailed(f"{command[0]} ran past the timeout of {timeout:g} seconds; its processes were killed")
        if header.get("untraced") and not (untraced_ok or header.get("traced_ranks") or header.get("aux")):
            raise nothing_recorded(out)
        output_tail = b"".join(tail)[-TAIL_BYTES:].decode("utf-8", errors="replace")
        failed = tracer_failure(output_tail) if proc.returncode else None
        if failed is not None:  # every command says so, instead of blaming CMD
            raise TracerFailed(f"{failed} (the trace up to there is in {out})")
        return LaunchResult(returncode=proc.returncode, out=out, command=command, elapsed=elapsed,
                            output_tail=output_tail, cut_short=cut_short, interrupted=bool(terms))


@contextlib.contextmanager
def _forwarding_sigterm(proc: subprocess.Popen[bytes], terms: list[int]) -> Iterator[None]:
    """While CMD runs, SIGTERM to the launcher goes to CMD's process group (appended to `terms`); a second one
    kills the group. Only the main thread may set a handler: elsewhere SIGTERM keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        terms.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL if len(terms) > 1 else signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)



def describe(result: LaunchResult) -> str:
    """One line for the terminal: where the trace is and what it holds."""
    try:
        header = json.loads(run_header_path(result.out).read_text())
    except (OSError, ValueError):
        header = {}
    try:
        run = RunHeader.from_json(header, "run.json") if header else None
    except TraceError:
        run = None
    traced = header.get("traced_ranks") or []
    took = f"({result.elapsed:.1f} s, exit code {result.returncode})"
    refused = refusal(result.output_tail) if result.returncode else None
    if not traced and refused is not None:
        # CMD ended on one of detrace's own refusals, whose sentence it printed: that, not the tracer, is why
        # nothing was recorded ("the tracer starts in each Python process..." would send the user looking for it).
        line = f"CMD ended on detrace's refusal {took}, before anything was recorded in {result.out}: {refused}"
    elif not traced and run is not None and not header.get("aux"):
        line = f"nothing was recorded in {result.out} {took}: {run.why_nothing_recorded()}"
    else:
        line = (f"trace of {len(traced)} rank{'s' * (len(traced) != 1)} at rung {header.get('rung', '?')} written "
                f"to {result.out} {took}")
        if run is not None and run.untraced:  # some processes were traced, and some not
            line += f"; {run.why_nothing_recorded()}, so it recorded nothing"
    if result.interrupted:
        line += "; interrupted by SIGTERM, which was passed on to CMD"
    if result.cut_short:
        line += f"; the trace is cut short: {result.cut_short}"
    return line
