"""Running the audit of CMD and reading, merging and printing what its ranks wrote.

`audit_command` takes the function that runs CMD (`launch`, by default the tracer's launcher) as a parameter,
so its reading and verdict logic is tested in process on rank files written by hand.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.investigate.audit.records import AUDIT_DIR, ENV_AUDIT, FIXERS, SCHEMA, AuditReport, Hazard, merge
from detrace.launch.launcher import LaunchResult, run_traced
from detrace.verdicts import AUDIT, AuditVerdict

Launch = Callable[..., LaunchResult]


def read_ranks(out: Path) -> tuple[list[Hazard], list[int], int]:
    """The hazards every rank of a run directory wrote, the ranks that wrote, and the steps they audited."""
    hazards: list[Hazard] = []
    ranks: list[int] = []
    steps = 0
    for path in sorted((Path(out) / AUDIT_DIR).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise TraceError(f"cannot read the audit file {path}: {err}") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise TraceError(f"{path} is not an audit file of schema {SCHEMA}")
        ranks.append(int(data["rank"]))
        steps = max(steps, int(data.get("steps", 0)))
        hazards += [Hazard.from_json(h) for h in data.get("hazards", ())]
    return hazards, sorted(ranks), steps


def audit_command(command: Sequence[str], *, out: Path, steps: int = 2, timeout: float | None = None,
                  force: bool = False, quiet: bool = False, launch: Launch = run_traced) -> AuditReport:
    """Run CMD once with the probe armed in each of its processes, and merge what the ranks saw.

    Raises UsageError for bad options, CommandFailed when CMD failed before any rank wrote its audit."""
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, not {steps}")
    if not command:
        raise UsageError("no command to audit; give it after '--', e.g. detrace audit -- python train.py")
    # The module rung over the audited steps keeps the place (step, phase, module scope) the probe reports.
    result = launch(list(command), out, rung="module", steps=f"0-{steps - 1}", env={ENV_AUDIT: str(steps)},
                    timeout=timeout, force=force, quiet=quiet)
    hazards, ranks, audited = read_ranks(result.out)
    notes = []
    if not ranks:
        tail = result.output_tail.strip().splitlines()[-1:] or ["no output"]
        raise CommandFailed(f"{command[0]} exited with code {result.returncode} before any rank wrote its audit "
                            f"(last line: {tail[0]})")
    if audited == 0:
        ended = "crashed" if result.returncode else "ended"
        raise CommandFailed(f"nothing audited: {command[0]} {ended} (exit code {result.returncode}) before its first "
                            f"optimizer step; what its ranks saw until then is in {Path(result.out) / AUDIT_DIR}")
    if result.returncode != 0:
        notes.append(f"CMD exited with code {result.returncode}: the audit covers what ran before")
    if audited < steps:
        notes.append(f"CMD ran {audited} step{'s' * (audited != 1)} of the {steps} asked for")
    return AuditReport(hazards=tuple(merge(hazards)), command=tuple(command), returncode=result.returncode,
                       ranks=tuple(ranks), steps=audited, out=str(result.out), notes=tuple(notes))


def prediction(run: Path, culprit: str) -> str | None:
    """What the audit of a run (written when the run was armed with DETRACE_AUDIT, as `detrace locate` arms its
    first run) says of a culprit op or kernel (`aten.index_put.default`, `inductor.cpp_fused_...`): one sentence,
    or None when that run has no audit."""
    try:
        hazards = merge(read_ranks(run)[0])
    except TraceError:
        return None
    if not (run / AUDIT_DIR).is_dir():
        return None
    name = culprit.removeprefix("inductor.")
    for hazard in hazards:
        if hazard.kind in ("op", "kernel") and hazard.subject == name:
            return (f"the audit of the first run predicted it: a {hazard.certainty} hazard at {hazard.place} "
                    f"({hazard.what}); fix: {hazard.fix}")
    certain = [h.subject for h in hazards if h.certainty == "certain"]
    return (f"the audit of the first run did not predict it; it found {len(certain)} certain "
            f"hazard{'s' * (len(certain) != 1)}{': ' + ', '.join(certain) if certain else ''}")


def settings_report() -> AuditReport:
    """The no-CMD form: this process's settings (what `detrace doctor` checks), as hazards."""
    from detrace.investigate.audit.judge import settings_hazards
    from detrace.recipe.doctor import audit

    return AuditReport(hazards=tuple(merge(settings_hazards(audit()))))


def verdict(report: AuditReport) -> AuditVerdict:
    return "hazards" if report.certain else "clean"


def exit_code(report: AuditReport) -> int:
    return AUDIT[verdict(report)]


def _block(hazard: Hazard) -> list[str]:
    head = f"  [{hazard.kind}] {hazard.subject}"
    if hazard.aten:
        head += f" (from {', '.join(hazard.aten)})"
    lines = [head]
    where = hazard.place
    if hazard.count > 1:
        where += f"{', ' if where else ''}{hazard.count} times"
    if where:
        lines.append(f"      at: {where}")
    for label, text in (("why", hazard.what), ("fix", f"{hazard.fix} [{FIXERS[hazard.fixed_by]}]")):
        lines += textwrap.wrap(text, 112, initial_indent=f"      {label}: ", subsequent_indent=" " * 11)
    return lines


def render(report: AuditReport, stream: TextIO) -> None:
    """The report for a terminal: certain hazards, then possible ones, then what fixes how many."""
    certain, possible = report.certain, report.possible
    lines = []
    for title, group in (("certain hazards", certain), ("possible hazards", possible)):
        if group:
            lines.append(f"{title} ({len(group)}):")
            for hazard in group:
                lines += _block(hazard)
    counts = {fixer: sum(h.fixed_by == fixer for h in report.hazards) for fixer in FIXERS}
    if report.hazards:
        lines.append("fixed by " + "; ".join(f"{name}: {counts[fixer]}" for fixer, name in FIXERS.items()
                                             if fixer != "code")
                     + f"; needing a code change: {counts['code']}")
    lines += [f"note: {note}" for note in report.notes]
    scope = (f" ({len(report.ranks)} rank{'s' * (len(report.ranks) != 1)}, {report.steps} "
             f"step{'s' * (report.steps != 1)} audited, {report.out})" if report.command else " (settings only)")
    summary = (f"{len(certain)} certain hazard{'s' * (len(certain) != 1)}, {len(possible)} possible"
               if report.hazards else "no hazard")
    lines.append(f"detrace audit: {summary}{scope}")
    stream.write("\n".join(lines) + "\n")


def to_json(report: AuditReport) -> dict[str, Any]:
    return report.to_json()
