"""`detrace doctor`: audit this environment's determinism settings; exit 1 when one is off.

Each switch of the recipe (detrace.recipe) is shown as ok, pending (at its default: `detrace.deterministic()`
sets it when the training script calls it), conflict (set against the recipe) or too-late, followed by the
risks the recipe cannot remove. A table on a terminal, plain lines when piped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from detrace.cli._args import ArgumentParser
from detrace.recipe import Finding
from detrace.recipe.doctor import audit
from detrace.report.terminal import make_console
from detrace.tracefile.layout import NATIVE_CHECK_LOCK, RUNS_DIR
from detrace.verdicts import DOCTOR

_STYLE = {"ok": "green", "pending": "cyan", "risk": "yellow", "conflict": "bold red", "too-late": "bold red"}


def main(argv: list[str]) -> int:
    ArgumentParser("doctor", description="Audit this environment's determinism settings.").parse_args(argv)
    findings = audit()
    if sys.stdout.isatty():
        _print_table(findings)
    else:
        for finding in findings:
            print(f"{finding.status:<8}  {finding.name} = {finding.value}  ({finding.detail})")
    off = [finding for finding in findings if finding.off]
    summary = (
        f"{len(off)} setting{'s' if len(off) > 1 else ''} off: {', '.join(finding.name for finding in off)}"
        if off
        else "no setting is off"
    )
    print(f"detrace doctor: {summary}")
    stopped = _stopped_check()
    if stopped is not None:  # (not a setting: the exit code stays the settings')
        print(f"detrace doctor: a check-resume --native writing into {stopped} was killed before it put back the "
              f"checkpoints it had moved aside; run: detrace check-resume --recover {stopped}")
    return DOCTOR["settings-off" if off else "ok"]


def _stopped_check() -> Path | None:
    """The OUT of a check-resume --native killed in this working directory before it put files back, or None."""
    if not (Path.cwd() / RUNS_DIR / NATIVE_CHECK_LOCK).is_file():
        return None  # (the common case, without importing the check: a second at start-up)
    from detrace.investigate.native_resume import stopped_check

    return stopped_check(Path.cwd())


def _print_table(findings: list[Finding]) -> None:
    from rich.table import Table

    table = Table(title="detrace doctor: determinism settings")
    for column in ("status", "setting", "value", "detail"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        style = _STYLE[finding.status]
        table.add_row(f"[{style}]{finding.status}[/]", finding.name, finding.value, finding.detail)
    make_console().print(table)
