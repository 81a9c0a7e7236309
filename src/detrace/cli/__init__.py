"""The `detrace` command line: one module per subcommand, each exposing `main(argv) -> int`.

Errors derived from `DetraceError` are printed as one sentence on stderr and mapped to their exit code;
no traceback reaches the user for anything they can fix.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from detrace.errors import DetraceError

# subcommand -> (module, one-line help). Modules are imported lazily so `detrace doctor` stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "run CMD with the tracer injected into every Python process it starts"),
    "diff": ("diff", "compare two run directories and name the first divergent bit"),
    "locate": ("locate", "drive the whole ladder on CMD (or the reference workload) to find the culprit op"),
    "check": ("check", "run CMD N times and require bit-identical traces"),
    "check-resume": ("check_resume", "verify that stopping at step K and resuming changes no bit"),
    "check-topology": ("check_topology", "run CMD at several world sizes and require the same bits at each"),
    "replay": ("replay", "kernel rung: re-execute one captured op to test it for nondeterminism"),
    "report": ("report", "write a self-contained HTML report of a run or locate directory"),
    "compare": ("compare", "measure an intentional change against the run-to-run variation of a baseline"),
    "verify-checkpoint": ("verify_checkpoint", "check a checkpoint against its fingerprint manifest"),
    "audit": ("audit", "run CMD once and report every determinism hazard it shows, with its place and fix"),
    "doctor": ("doctor", "audit this environment's determinism settings"),
    "certify": ("certify", "check a trace's invariants (ranks, steps, dense sequence numbers)"),
    "validate": ("validate", "run the validation matrix of the reference workload"),
    "fingerprint": ("fingerprint", "print the fingerprint of tensors in a .pt/.safetensors file or a demo"),
    "spikes": ("spikes", "list the steps where a metric jumps above its trailing median + k x MAD"),
    "ablate": ("ablate", "replay a spike from a checkpoint and change one thing at a time to isolate its cause"),
    "recheck": ("recheck", "re-execute one step on the same and other devices: transient, persistent or software"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: detrace COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Run 'detrace COMMAND --help' for the options of one command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from detrace import __version__

        print(f"detrace {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"detrace: error: unknown command {name!r}; run 'detrace --help' for the list", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"detrace.cli.{COMMANDS[name][0]}")
        return module.main(rest)
    except DetraceError as err:
        print(f"detrace {name}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"detrace {name}: interrupted", file=sys.stderr)
        return 130


class _PipeGuard:
    """stdout that goes quiet once its reader has gone (`detrace diff A B --json | head -c 1`): the Unix convention
    is to stop writing without a word, and the command still ends with its verdict's exit code."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._discard()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._discard()

    def _discard(self) -> None:
        # What is still buffered, and everything after, goes to /dev/null: flushing it at exit cannot fail.
        self._gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run() -> None:
    """Console-script entry point."""
    sys.stdout = _PipeGuard(sys.stdout)
    try:
        code = main()
    finally:
        sys.stdout.flush()  # here, guarded: not at interpreter exit, where a closed pipe would print a traceback
    sys.exit(code)
