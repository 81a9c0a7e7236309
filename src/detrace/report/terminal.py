"""Human summaries of a diff and of a certification: rich on a terminal, plain text when piped.

Self-contained on purpose: it depends only on the result objects, so other renderers (report/html.py) can
evolve without touching it. The summary is short: the verdict, the first divergence with its module path and
op, what differs, the origin ranks, and a table of the divergent ranks.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from detrace.analyze.certify import CertifyResult
from detrace.analyze.diff_result import DiffResult, Divergence, RankResult

MAX_RANK_ROWS = 16
"""Divergent ranks listed one per row; the rest are counted."""
MAX_VIOLATIONS = 50
_STYLE = {"identical": "bold green", "diverged": "bold red", "incomparable": "bold yellow"}


def _where(d: Divergence) -> str:
    if d.stop is not None:
        return f"rank {d.rank}, step {d.step}: run {d.detail['ended'].upper()} has no step {d.step}"
    if d.phase == "final":
        return f"rank {d.rank}, after the last step ({d.step}), the final state: {d.name} ({d.role})"
    if d.phase == "data":
        return f"rank {d.rank}, step {d.step}, the input batch ({d.role}[{d.index}], call #{d.occurrence})"
    module = f" in {d.scope}" if d.scope else ""
    return f"rank {d.rank}, step {d.step}, {d.phase}{module}: {d.name} ({d.role}[{d.index}], call #{d.occurrence})"


def _span(values: list[int], limit: int = 12) -> str:
    text = ", ".join(map(str, values[:limit]))
    return text + (f" and {len(values) - limit} more" if len(values) > limit else "")


def _explain(d: Divergence, final: str | None = None) -> list[str]:
    """What differs, in a few indented lines; `final`: what a difference in the final state means (diff_lines)."""
    detail = d.detail
    lines: list[str] = []
    if d.kind == "numeric" and d.phase == "data":
        lines.append("the input batch differs: the data entering the model's forward is not the same in both runs; "
                     "no traced call computed it (look at the data order, the augmentation's randomness, the "
                     "loader's position)")
        if "digest" in detail:
            lines.append(f"digest {detail['digest'][0]} vs {detail['digest'][1]}")
    elif d.kind == "numeric" and d.phase == "final":
        lines.append(final or "every step matched, and the state the run ended with differs: it changed after the "
                     "last optimizer step (an unseeded draw, an average or a quantisation after the training?)")
        if "digest" in detail:
            lines.append(f"digest {detail['digest'][0]} vs {detail['digest'][1]}")
    elif d.kind == "numeric":
        lines.append("origin: its inputs were equal and its output differs" if d.origin else
                     "not an origin: an input of this call already differed")
        if "digest" in detail:
            lines.append(f"digest {detail['digest'][0]} vs {detail['digest'][1]}")
        if "value" in detail:
            lines.append(f"value {detail['value'][0]!r} vs {detail['value'][1]!r}")
        for name in ("shape", "dtype", "numel"):
            if name in detail:
                lines.append(f"{name} {detail[name][0]} vs {detail[name][1]}")
        if "chunks" in detail:
            lines.append(f"differing chunks along dim 0: {_span(detail['chunks'])} "
                         f"({len(detail['chunks'])} of {detail['chunks_total']})")
        if detail.get("inputs") or detail.get("outputs"):
            lines.append(f"call: {', '.join(detail.get('inputs', [])) or 'no inputs'} -> "
                         f"{', '.join(detail.get('outputs', [])) or 'no outputs'}")
        if "receiver" in detail:
            receiver = detail["receiver"]
            lines.append(f"first differing record: {receiver['label']} (step {receiver['step']}, "
                         f"seq {receiver['seq']}); walked back to this enclosing call")
        if detail.get("inputs_matched_on_all_ranks"):
            lines.append("every rank's inputs to this collective matched: the collective itself differs")
    elif d.kind == "structural":
        if "only_in_a" in detail:
            lines.append(f"the sequence of calls changed: {detail['only_in_a']} records only in A, "
                         f"{detail['only_in_b']} only in B (A: {detail['a']}; B: {detail['b']})")
        else:
            lines.append(f"the sequence of calls changed (A: {detail['a']}; B: {detail['b']}); "
                         f"resynchronised at step {detail['resynchronised_at_step']}")
    elif d.stop is not None:
        lines.append(f"{detail['records_left']} records only in the other run after the common steps, not compared"
                     if detail["records_left"] else "every record of the common steps is equal")
    else:
        run = detail["ended"].upper()
        state = "closed its trace" if detail["closed"] else "did not close its trace"
        lines.append(f"run {run}'s rank ended early and {state}: last common step {detail['last_common_step']}, "
                     f"{detail['records_left']} records only in the other run")
    return lines


def _rank_row(r: RankResult) -> tuple[str, str, str, str]:
    first = r.first
    what = "" if first is None else f"{first.kind} step {first.step} {first.phase} {first.module or ''} {first.name}"
    return str(r.rank), r.cause, " ".join(what.split()), r.via or ""


def diff_lines(result: DiffResult, *, final: str | None = None) -> list[str]:
    """The summary as plain lines (what a pipe gets). `final`: what a first divergence in the final state means, in
    place of the hint that fits two runs of one command (check-resume knows better: its resume left state behind)."""
    diverged = [r for r in result.ranks if r.first is not None]
    if result.verdict == "incomparable":
        return [f"incomparable: {result.reason}", *result.notes]
    unverified = result.compared.unverified
    note = [f"not verified: {unverified:,} records carry no digest (above --max-numel, or not fingerprintable);"
            " only their shapes and dtypes were compared"] if unverified else []
    note = [line for line in (result.steps, *result.notes) if line] + note
    if result.verdict == "identical":
        return [f"identical: {result.compared.ranks} ranks, {result.compared.records:,} records, every bit equal",
                *note]
    stop = result.first.stop if result.first is not None else None
    lines = [f"diverged: {stop}" if stop else
             f"diverged: {len(diverged)} of {result.compared.ranks} ranks differ "
             f"({result.compared.records:,} records compared)", *note]
    if result.first is not None:
        lines.append(f"first divergence: {_where(result.first)} [{result.first.kind}]")
        lines += [f"  {line}" for line in _explain(result.first, final)]
    lines.append(f"origin ranks: {_span(result.origin_ranks) or 'none found'}")
    return lines


PIPE_WIDTH = 1000
"""Columns of a console that is not a terminal: no line is wrapped and no kernel name cut (rich's default is 80)."""


def make_console(file: TextIO | None = None, *, stderr: bool = False) -> Console:
    """The console every command prints with: styled on a terminal; piped, plain lines that are never wrapped."""
    stream = file or (sys.stderr if stderr else sys.stdout)
    piped = not (hasattr(stream, "isatty") and stream.isatty())
    return Console(file=stream, highlight=False, soft_wrap=piped, width=PIPE_WIDTH if piped else None)


def render_diff(result: DiffResult, file: TextIO | None = None, *, final: str | None = None) -> None:
    """Print the diff summary: styled on a terminal, plain when `file` is not one (`final`: see diff_lines)."""
    console = Console(file=file or sys.stdout, highlight=False)
    lines = diff_lines(result, final=final)
    diverged = [r for r in result.ranks if r.first is not None]
    rows = [_rank_row(r) for r in diverged[:MAX_RANK_ROWS]]
    more = len(diverged) - len(rows)
    if not console.is_terminal:
        out = console.file
        for line in lines:
            print(line, file=out)
        if len(diverged) > 1:
            widths = [max(len(row[i]) for row in [("rank", "cause", "first", "via"), *rows]) for i in range(4)]
            for row in [("rank", "cause", "first", "via"), *rows]:
                print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out)
            if more:
                print(f"  ... and {more} more divergent ranks", file=out)
        return
    verdict, _, rest = lines[0].partition(":")
    console.print(Text.assemble((verdict, _STYLE[result.verdict]), ":" + rest))
    for line in lines[1:]:
        console.print(Text(line, style="bold" if line.startswith("first divergence") else ""))
    if len(diverged) > 1:
        table = Table("rank", "cause", "first", "via", box=None, pad_edge=False)
        for row in rows:
            table.add_row(row[0], Text(row[1], style="red" if row[1] == "origin" else ""), row[2], row[3])
        console.print(table)
        if more:
            console.print(f"... and {more} more divergent ranks", style="dim")


def certify_lines(result: CertifyResult) -> list[str]:
    """The certification as plain lines."""
    if result.ok:
        return [f"certified: {result.run}: {len(result.ranks)} ranks x {len(result.steps)} steps, "
                f"{result.records:,} records; every invariant holds"]
    shown = result.violations[:MAX_VIOLATIONS]
    lines = [f"not certified: {result.run}: {len(result.violations)} violations"]
    lines += [f"  {v}" for v in shown]
    if len(result.violations) > len(shown):
        lines.append(f"  ... and {len(result.violations) - len(shown)} more")
    return lines


def render_certify(result: CertifyResult, file: TextIO | None = None) -> None:
    """Print the certification: styled on a terminal, plain when piped."""
    console = Console(file=file or sys.stdout, highlight=False)
    lines = certify_lines(result)
    if not console.is_terminal:
        for line in lines:
            print(line, file=console.file)
        return
    console.print(Text(lines[0], style="bold green" if result.ok else "bold red"))
    for line in lines[1:]:
        console.print(Text(line))
