"""The error hierarchy of detrace. Every error the CLI can report maps to one exit code.

Every command answers a question, and its exit code says how: 0 means "yes" (identical, deterministic, intact),
1 means "the answer is no" (diverged, nondeterministic, corrupted), 2 means "no answer could be given" (bad input,
incomparable, unreadable). A command that runs the user's program (`detrace run`) exits with the program's code.
"""

from __future__ import annotations


class DetraceError(Exception):
    """Base class. The message is one sentence meant for the user; the CLI prints it without a traceback."""

    exit_code: int = 2


class UsageError(DetraceError):
    """Bad command-line arguments or API arguments (malformed SPEC, unknown rung, missing CMD)."""


class TraceError(DetraceError):
    """A trace directory or file that is missing, empty, malformed or of another schema version."""


class NothingRecorded(TraceError):
    """A finished run directory without a rank file: nothing was recorded (the message says why: the tracer did not
    start in CMD, or no process of CMD recorded anything)."""


class UntrustedCode(DetraceError):
    """A trace names code to execute (a compiled kernel's output code) that the user did not trust, or whose
    bytes no longer match the hash recorded when the trace was made."""


class IncomparableError(DetraceError):
    """Two runs that cannot be compared (different world sizes, schemas or parallel layouts)."""


class CheckpointError(DetraceError):
    """A checkpoint that is missing, unreadable, or of an unknown format."""


class CheckpointCorrupted(CheckpointError):
    """A checkpoint whose tensors do not match their fingerprint manifest."""

    exit_code = 1


class DeterminismError(DetraceError):
    """A determinism setting that conflicts with the recipe, or that was applied too late to take effect."""


class CommandFailed(DetraceError):
    """The user's command (CMD) could not be started, crashed, or ran past its timeout."""


class FingerprintError(DetraceError, TypeError):
    """A tensor that cannot be fingerprinted (meta tensors, tensors without storage)."""


def os_error_text(err: OSError, path: object) -> str:
    """An OSError in words for one sentence: a full disk names the device by the path it holds ("no space left
    on the device that holds /runs/a"), anything else is the system's own words."""
    import errno

    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device that holds {path}"
    return str(err.strerror or err)
