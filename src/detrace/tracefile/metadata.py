"""The JSON metadata of a trace, each validated against its schema in one place: the run header (`run.json`,
and the header every rank file carries) and the rank footer (`rank-RRRRR.json`).

Every reader goes through `RunHeader.from_json` / `RankFooter.from_json`: a file of the wrong shape (a list
instead of an object, `world_size: "x"`) is refused with one sentence naming the file and the field, instead of
failing later wherever the value happens to be used. Keys this version does not know are kept, not refused, so
tools that add facts stay readable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detrace.errors import TraceError, UsageError
from detrace.tracefile.layout import require_regular
from detrace.tracefile.schema import RUNGS, SCHEMA_VERSION, format_refusal
from detrace.tracefile.schemes import SCHEME, SCHEMES
from detrace.tracefile.selection import parse_window

_MISSING = object()


class Fields:
    """Typed access to one JSON object's fields, each failure one sentence naming the file and the field (every
    `from_json` of a record detrace writes reads through it)."""

    def __init__(self, raw: object, source: str) -> None:
        if not isinstance(raw, dict):
            raise TraceError(f"{source} is malformed: it holds a JSON {type(raw).__name__}, not an object")
        self.raw: dict[str, Any] = raw
        self.source = source

    def fail(self, key: str, wanted: str) -> TraceError:
        """The error for a field that is present but not what the schema says."""
        return TraceError(f"{self.source} is malformed: field {key!r} must be {wanted}, not "
                          f"{json.dumps(self.raw.get(key))[:60]}")

    def get(self, key: str, kind: type | tuple[type, ...], wanted: str, *, default: Any = _MISSING) -> Any:
        value = self.raw.get(key, _MISSING)
        if value is _MISSING or (value is None and default is None):
            if default is _MISSING:
                raise TraceError(f"{self.source} is malformed: field {key!r} is missing")
            return default
        # bool is an int to Python, never to a schema
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
            raise self.fail(key, wanted)
        return value

    def count(self, key: str, *, default: Any = _MISSING, least: int = 0) -> Any:
        value = self.get(key, int, f"an integer of at least {least}", default=default)
        if value is not None and value is not default and value < least:
            raise self.fail(key, f"an integer of at least {least}")
        return value

    def strings(self, key: str, *, default: Any = _MISSING) -> Any:
        value = self.get(key, list, "a list of strings", default=default)
        if value is not None and value is not default and not all(isinstance(v, str) for v in value):
            raise self.fail(key, "a list of strings")
        return value

    def choice(self, key: str, options: tuple[str, ...], *, default: Any = _MISSING) -> Any:
        wanted = "one of " + ", ".join(options)
        value = self.get(key, str, wanted, default=default)
        if value is not default and value not in options:
            raise self.fail(key, wanted)
        return value

    def spec(self, key: str) -> str | None:
        value = self.get(key, str, "a SPEC", default=None)
        if value is not None:
            try:
                parse_window(value)
            except UsageError as err:
                raise TraceError(f"{self.source} is malformed: field {key!r}: {err}") from None
        return value

    def schema(self, *, default: Any = _MISSING) -> Any:
        version = self.get("schema", str, "a string", default=default)
        if version is not default and version != SCHEMA_VERSION:
            raise TraceError(format_refusal(self.source, version))
        return version


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


@dataclass(frozen=True, kw_only=True)
class Windows:
    """The windows a run was recorded with."""

    steps: str | dict[str, str] | None
    """One step SPEC, or one per rung."""
    ranks: str | None
    """The rank SPEC."""
    max_numel: int | None
    """--max-numel."""
    capture: str | None
    """--capture."""

    @classmethod
    def from_json(cls, raw: object, source: str) -> Windows:
        fields = Fields(raw, f"{source} (field 'windows')")
        steps = fields.get("steps", (str, dict), "a SPEC or an object of SPECs per rung", default=None)
        if isinstance(steps, dict):
            if not all(k in RUNGS and isinstance(v, str) for k, v in steps.items()):
                raise fields.fail("steps", f"an object mapping rungs ({', '.join(RUNGS)}) to SPECs")
            per_rung = Fields(steps, f"{fields.source} (field 'steps')")
            for rung in steps:
                per_rung.spec(rung)
        elif steps is not None:
            fields.spec("steps")
        return cls(steps=steps, ranks=fields.spec("ranks"),
                   max_numel=fields.count("max_numel", default=None),
                   capture=fields.get("capture", str, "a string", default=None))


@dataclass(frozen=True, kw_only=True)
class RunHeader:
    """A run header: `run.json` or the header of one rank file (which adds `rank` and `pid`)."""

    schema: str | None
    """The trace format, SCHEMA_VERSION (rank headers may leave it to the file's schema metadata)."""
    command: list[str]
    """The traced command."""
    world_size: int | None
    """Ranks in the run, when known."""
    rung: str | None
    """The deepest rung recorded."""
    windows: Windows | None
    """The windows the run was recorded with."""
    ranks: str | None
    """The rank SPEC."""
    traced_ranks: list[int]
    """run.json: the ranks that wrote a trace."""
    status: str | None
    """run.json: running | finished | timeout | failed to start."""
    returncode: int | None
    """run.json: CMD's exit status."""
    rank: int | None
    """Rank headers: the rank."""
    pid: int | None
    """Rank headers: the process that wrote the trace."""
    versions: dict[str, Any] | None
    """The versions of Python, torch and detrace the run used (`record.header.versions`)."""
    determinism: dict[str, Any] | None
    """The determinism settings the run saw (`record.header.determinism`)."""
    steps: tuple[int, int] | None
    """run.json of a finished run: the first and last global step its ranks ran (from their footers)."""
    fingerprint: str
    """The fingerprint scheme of its digests (`detrace.digest.scheme`); detrace-fp1 when the header has none, as
    every trace written before detrace-fp2 existed."""
    untraced: tuple[tuple[int, str], ...] = ()
    """run.json: the processes of CMD whose tracer did not start, as (pid, why), by pid."""
    raw: dict[str, Any] = field(repr=False)
    """The object as read (validated), for the keys above and any others."""

    @classmethod
    def from_json(cls, raw: object, source: str) -> RunHeader:
        """Validate a parsed header; raises TraceError naming `source` and the field."""
        fields = Fields(raw, source)
        rung = fields.get("rung", str, "a rung name", default=None)
        if rung is not None and rung not in RUNGS:
            raise fields.fail("rung", f"one of {', '.join(RUNGS)}")
        traced = fields.get("traced_ranks", list, "a list of ranks", default=[])
        if not all(_is_count(r) for r in traced):
            raise fields.fail("traced_ranks", "a list of ranks")
        versions, determinism = (fields.get(key, dict, "an object", default=None)
                                 for key in ("versions", "determinism"))
        fields.get("elapsed", (int, float), "a number of seconds", default=None)
        pid = fields.count("pid", default=None)
        windows = fields.get("windows", dict, "an object", default=None)
        steps = fields.get("steps", dict, "an object", default=None)
        if steps is not None and not (_is_count(steps.get("first")) and _is_count(steps.get("last"))):
            raise fields.fail("steps", "an object of the first and last global step run")
        untraced = fields.get("untraced", list, "a list of processes", default=[])
        if not all(isinstance(u, dict) and _is_count(u.get("pid")) and isinstance(u.get("reason"), str)
                   for u in untraced):
            raise fields.fail("untraced", "a list of objects with a pid and a reason")
        return cls(schema=fields.schema(default=None), command=fields.strings("command", default=[]),
                   world_size=fields.count("world_size", default=None, least=1), rung=rung,
                   windows=None if windows is None else Windows.from_json(windows, source),
                   ranks=fields.spec("ranks"), traced_ranks=traced,
                   status=fields.get("status", str, "a string", default=None),
                   returncode=fields.get("returncode", int, "an integer", default=None),
                   rank=fields.count("rank", default=None), pid=pid, versions=versions, determinism=determinism,
                   steps=None if steps is None else (steps["first"], steps["last"]),
                   fingerprint=fields.choice("fingerprint", SCHEMES, default=SCHEME),
                   untraced=tuple((u["pid"], u["reason"]) for u in untraced), raw=fields.raw)

    def why_nothing_recorded(self) -> str:
        """Why a run that wrote no rank file recorded nothing, in words that follow "nothing was recorded: "."""
        if self.untraced:
            (pid, reason), *others = self.untraced
            more = f" (and in {len(others)} other process{'es' * (len(others) > 1)})" if others else ""
            return f"the tracer did not start in process {pid}{more}: {reason}"
        windows = "" if self.ranks in (None, "all") else f" among the ranks it records ({self.ranks})"
        return (f"no process of its command recorded anything{windows}; the tracer starts in each Python process "
                "that imports torch, and records its ops and steps")


@dataclass(frozen=True, kw_only=True)
class StepAccount:
    """A rank footer's account of the global steps the rank ran (the tracer's `StepClock.steps`)."""

    first: int | None
    """The first global step the rank ran (K for a run resumed after step K); None when not recorded."""
    recorded: tuple[int, int] | None
    """The first and last global step holding records; None when the rank recorded none."""
    source: str | None
    """Where the numbering came from ("process": counted from the process's start; "optimizer", "env", a
    framework integration...); None when not recorded."""

    @classmethod
    def from_json(cls, fields: Fields) -> StepAccount | None:
        """The footer's `steps` object, or None when the footer has none; raises TraceError naming the field."""
        steps = fields.get("steps", dict, "an object", default=None)
        if steps is None:
            return None
        first, recorded, source = steps.get("first"), steps.get("recorded"), steps.get("source")
        if first is not None and not _is_count(first):
            raise fields.fail("steps", "an object whose `first` is a non-negative integer")
        if recorded is not None and not (isinstance(recorded, list) and len(recorded) == 2
                                         and all(_is_count(s) for s in recorded) and recorded[0] <= recorded[1]):
            raise fields.fail("steps", "an object whose `recorded` is the first and last step recorded")
        if source is not None and not isinstance(source, str):
            raise fields.fail("steps", "an object whose `source` is a string")
        return cls(first=first, recorded=None if recorded is None else (recorded[0], recorded[1]), source=source)


@dataclass(frozen=True, kw_only=True)
class RankFooter:
    """The footer a rank writes when it closes cleanly, validated once when read (`tracefile.reader.load_footer`)
    and handed on as it is: no one reads fields out of the JSON object."""

    schema: str
    """The trace format, SCHEMA_VERSION."""
    rank: int | None
    """The rank; None in an auxiliary process's footer (`aux-<pid>.json`, a process that is not a rank)."""
    records: int
    """Records written."""
    batches: int
    """Record batches written."""
    chain: str
    """The integrity chain after the last batch (tracefile.integrity)."""
    last_step: int
    """The step of the last record (-1 when none)."""
    arrow_footer: str | None
    """The checksum of the rank file's Arrow file footer (tracefile.integrity.arrow_footer_checksum), 16 hex
    digits; None in traces written before it was recorded."""
    groups: tuple[str, ...] | None = None
    """The process groups the rank used ("0,1"): its parallel layout; None when not recorded."""
    steps: StepAccount | None = None
    """The global steps the rank ran; None when not recorded."""
    world_size: int | None = None
    """The world size the rank saw; None when not recorded."""
    step: int | None = None
    """The tracer's step clock when the rank closed; None when not recorded."""
    collectives: int | None = None
    """Collective calls the rank made; None when not recorded."""
    pid: int | None = None
    """The process that wrote the trace; None when not recorded."""
    rebuilt: bool = False
    """The footer file is missing and the rank file was closed (it ends in its Arrow file footer): this footer was
    read from the rank file's records (`tracefile.reader.rebuilt_footer`), and its file is named as missing."""

    @property
    def first_step(self) -> int | None:
        """The first global step the rank ran (`steps.first`: K for a run resumed after step K); None when absent."""
        return None if self.steps is None else self.steps.first

    @classmethod
    def from_json(cls, raw: object, source: str) -> RankFooter:
        """Validate a parsed footer; raises TraceError naming `source` and the field."""
        fields = Fields(raw, source)
        chain, arrow_footer = _checksum_text(fields, "chain"), _checksum_text(fields, "arrow_footer", default=None)
        fields.get("complete", bool, "true or false", default=None)
        step, pid, collectives = (fields.count(key, default=None) for key in ("step", "pid", "collectives"))
        world_size = fields.count("world_size", default=None, least=1)
        steps = StepAccount.from_json(fields)
        return cls(schema=fields.schema(), rank=fields.count("rank", default=None), records=fields.count("records"),
                   batches=fields.count("batches"), chain=chain, last_step=fields.count("last_step", least=-1),
                   groups=_strings(fields.strings("groups", default=None)), steps=steps, world_size=world_size,
                   step=step, collectives=collectives, pid=pid, arrow_footer=arrow_footer)


def _strings(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _is_count(value: object) -> bool:
    """A non-negative integer, and not a bool (an int to Python, never to a schema)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checksum_text(fields: Fields, key: str, **default: Any) -> Any:
    """A checksum field: 16 lowercase hexadecimal digits (tracefile.integrity.chain_text)."""
    value = fields.get(key, str, "16 hexadecimal digits", **default)
    if value is not None and (len(value) != 16 or any(c not in "0123456789abcdef" for c in value)):
        raise fields.fail(key, "16 hexadecimal digits")
    return value


def load_json(path: Path, what: str) -> object:
    """Parse a metadata file, one sentence when it cannot be read; FileNotFoundError passes through."""
    try:
        require_regular(path, what)
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise TraceError(f"{what} {path} is unreadable: {err}") from None

