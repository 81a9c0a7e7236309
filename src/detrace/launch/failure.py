"""Whose failure a crash was: CMD's, or the tracer's inside it.

The tracer runs inside CMD (its hooks, its wrappers of torch's functions), so a bug of detrace's ends CMD with a
traceback like any other, and a command that blamed CMD ("CMD crashed before its first step") would send the user
to debug their own code. The last traceback in CMD's output says which it was: walking its frames from the
innermost out, torch's and the standard library's frames are passed over (they run for whoever called them), and
so are detrace's frames that only hand a call on to the function it wraps (`return original(*args, **kwargs)`:
an error there is the wrapped function's, raised for the program as it would be untraced). The first frame left
decides: detrace's own code means that detrace failed.
"""

from __future__ import annotations

import importlib.util
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from detrace.errors import DetraceError

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\s*$')
_HANDS_ON = re.compile(r"\b(?:original\w*|function|func|fn|run|call|closure|wrapped|inner)\(")
"""A line of detrace's that hands a call on to the function it wraps (see the module's docstring)."""
_REFUSAL = re.compile(r"detrace\.errors\.\w+: ")
"""How a traceback ends on one of detrace's own errors (`detrace.errors`): a refusal of what the program gave or
asked for (a malformed DETRACE_ variable, a checkpoint that does not fit), whose sentence the output holds."""
_DETRACE = Path(__file__).resolve().parents[1]
_EXAMPLES = _DETRACE / "examples"
"""detrace's example training scripts: the user's code when they are CMD."""


class TracerFailed(DetraceError):
    """CMD ended on an exception raised in detrace's own code (a bug of detrace's, not of CMD)."""


@dataclass(frozen=True, kw_only=True)
class Frame:
    """One frame of a printed traceback."""

    path: str
    line: int
    function: str
    source: str
    """The line of source the traceback printed under it ("" when none)."""


def _library_dirs() -> list[Path]:
    """The code that runs for whoever called it: torch (located, not imported), the standard library, and the
    environment's console scripts (`torchrun`'s own file, whose traceback follows a failed worker's)."""
    paths = sysconfig.get_paths()
    found = [Path(paths["stdlib"]).resolve(), Path(paths["scripts"]).resolve()]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        found += [Path(location).resolve() for location in spec.submodule_search_locations]
    return found


def tracebacks(output: str) -> list[tuple[list[Frame], str]]:
    """The Python tracebacks in `output`, last first: each one's frames, outermost first, and its exception line
    (the first one may have lost its outer frames: CMD's output is kept from its tail)."""
    lines = output.splitlines()
    starts = [i for i, text in enumerate(lines) if text.strip() == "Traceback (most recent call last):"]
    if any(_FRAME.match(text) for text in lines[:starts[0] if starts else len(lines)]):
        starts.insert(0, -1)  # the output's tail began inside a traceback, its first line cut off
    found: list[tuple[list[Frame], str]] = []
    for start in reversed(starts):
        frames: list[Frame] = []
        error = ""
        rest = lines[start + 1:]
        for i, text in enumerate(rest):
            match = _FRAME.match(text)
            if match is not None:
                following = rest[i + 1] if i + 1 < len(rest) else ""
                frames.append(Frame(path=match["path"], line=int(match["line"]), function=match["function"],
                                    source="" if _FRAME.match(following) else following.strip()))
            elif frames and text and not text[0].isspace():
                error = text.strip()
                break
        if frames:
            found.append((frames, error))
    return found


def _within(path: Path, folders: list[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def _deciding_frame(frames: list[Frame], libraries: list[Path]) -> tuple[Frame, Path, bool] | None:
    """The frame that says whose failure a traceback is (see the module's docstring), its resolved path, and whether
    it is detrace's own code; None when every frame is passed over (torchrun's own traceback, after a worker's)."""
    for frame in reversed(frames):
        path = Path(frame.path).resolve()
        ours = path.is_relative_to(_DETRACE) and not path.is_relative_to(_EXAMPLES)
        if (not ours and _within(path, libraries)) or (ours and _HANDS_ON.search(frame.source)):
            continue
        return frame, path, ours
    return None


def tracer_failure(output: str) -> str | None:
    """"detrace failed ..." when the last traceback in CMD's output ends in detrace's own code (see the module's
    docstring), naming the exception and the frame; None when it ends in CMD's code, or there is no traceback. A
    traceback of torch's and the standard library's frames alone (torchrun's own, after a worker failed) says
    nothing: the one before it does."""
    libraries = _library_dirs()
    for frames, error in tracebacks(output):
        if _REFUSAL.match(error):  # raised on purpose: the program's input refused in its sentence, not a crash
            return None
        decided = _deciding_frame(frames, libraries)
        if decided is None:
            continue
        frame, path, ours = decided
        if not ours:
            return None
        where = f"{path.relative_to(_DETRACE.parent)}, line {frame.line}, in {frame.function}"
        return (f"detrace failed, not CMD: {error or 'an exception'} was raised in detrace's own code ({where}); "
                "this is a bug of detrace's: please report it with this sentence")
    return None


def refusal(output: str) -> str | None:
    """The sentence of detrace's own refusal (a `detrace.errors` exception: a contract variable refused, a
    checkpoint that does not fit) when CMD's last traceback ends on one, as `tracer_failure` picks the last (passing
    over torchrun's own); None otherwise. Such a run ended on purpose: what it recorded, or that it recorded
    nothing, is no fault of the tracer's."""
    libraries = _library_dirs()
    for frames, error in tracebacks(output):
        if (match := _REFUSAL.match(error)) is not None:
            return error[match.end():]
        if _deciding_frame(frames, libraries) is not None:
            return None
    return None
