"""The HTML report: one self-contained file (inline CSS and SVG, no script, no network) of a run or a locate.

For a locate directory (`detrace locate --out DIR`) it draws, from the runs the ladder kept:

- the metric curves of the two broad runs and the step where they part, beside the step where the trace parts
  (the earliest divergent bit often comes steps before the loss shows it);
- a ranks x steps map of where records differ: where divergence appears first and how it spreads;
- the narrowing path, step -> phase -> module -> op, with the culprit call's inputs and outputs
  (shape, dtype, equal or not);
- the kernel rung's replay of the culprit, arm by arm.

For a plain run directory it draws the run's metric curves and what each rank recorded.
Every number on the page comes from the trace files and ladder.json; nothing is estimated. The page functions
(`render_locate`, `render_run`) take typed data: the ladder record (`detrace.analyze.locate_result`), the metric
`Curves` and the spread map (`detrace.analyze`); `write_report` is the one place that reads them from disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.analyze.diff_result import scope_label
from detrace.analyze.locate_result import LADDER_FILE, LocateResult, Stage, load_ladder
from detrace.analyze.metrics import metric_rank, metric_series
from detrace.analyze.pairs import divergence_map
from detrace.analyze.replay_result import ReplayResult
from detrace.errors import TraceError
from detrace.report.svg import ORIGIN, bits, e, line_chart, spread_map
from detrace.tracefile import RankTrace, RunInfo, open_run, read_rank
from detrace.tracefile.layout import ABLATE_FILE, RANK_GLOB, REPORT_FILE, rank_trace_paths, run_header_path

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:#1d232b;max-width:1040px;margin:24px auto;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d9dee5;
padding-bottom:4px}
code,.mono{font-family:ui-monospace,'SFMono-Regular',Menlo,Consolas,monospace;font-size:12.5px}
.answer{font-size:16px;margin:8px 0 4px}.muted{color:#5d6773}
.badge{display:inline-block;padding:1px 9px;border-radius:10px;font-size:13px;color:#fff;vertical-align:middle}
.deterministic{background:#2e7d32}.nondeterministic{background:#c62828}.inconclusive{background:#ef6c00}
.run{background:#455a64}
table{border-collapse:collapse;margin:6px 0;max-width:100%}
td,th{border:1px solid #d9dee5;padding:3px 8px;text-align:left;overflow-wrap:break-word}td.any{overflow-wrap:anywhere}
th{background:#f2f4f7;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.differ{color:#c62828;font-weight:600}.same{color:#2e7d32}
ol.path{padding-left:22px}ol.path li{margin:6px 0}.path b{font-family:ui-monospace,Menlo,monospace}
.charts{display:flex;flex-wrap:wrap;gap:18px}.chart{flex:0 0 auto}
svg text{font:11px system-ui,sans-serif;fill:#3b4450}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:12px;height:12px;
vertical-align:-2px;margin-right:4px;border:1px solid #9aa4b0}
"""

_ARM_COLORS = ("#1565c0", "#ef6c00")


# -- page sections ---------------------------------------------------------------------------------------------


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>{e(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _table(header: list[str], rows: list[list[str]], *, raw: bool = False, anywhere: tuple[int, ...] = ()) -> str:
    """An HTML table; cells are escaped unless `raw` (callers then escape what they put in). The columns `anywhere`
    (paths, kernel names: long words) may break anywhere; the others only between words, since a table squeezed to
    the page's width would otherwise break every column mid-word ("sema ntic")."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    cell = ("<td>", '<td class="any">')
    body = "".join("<tr>" + "".join(f"{cell[i in anywhere]}{c if raw else e(c)}</td>" for i, c in enumerate(row))
                   + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _first_parting(a: dict[int, float], b: dict[int, float]) -> int | None:
    for step in sorted(a.keys() & b.keys()):
        if bits(a[step]) != bits(b[step]):
            return step
    return None


@dataclass(frozen=True, kw_only=True)
class Curves:
    """The metric curves the report draws: one rank's exact values in run A and, to compare, run B."""

    rank: int | None
    """The rank they come from (None: the run recorded no metrics)."""
    a: dict[str, dict[int, float]]
    """Run A: name -> step -> value."""
    b: dict[str, dict[int, float]] | None = None
    """Run B (None: a report of one run; empty: B has no trace of that rank)."""

    @classmethod
    def read(cls, run_a: Path, run_b: Path | None = None) -> Curves:
        rank = metric_rank(run_a)
        if rank is None:
            return cls(rank=None, a={})
        b = None if run_b is None else metric_series(run_b, rank) if rank in open_run(run_b).ranks else {}
        return cls(rank=rank, a=metric_series(run_a, rank), b=b)


def _metric_section(curves: Curves, trace_step: int | None) -> list[str]:
    if curves.rank is None:
        return ["<h2>Metric curves</h2><p class=\"muted\">The run recorded no metrics.</p>"]
    ma, mb = curves.a, curves.b or {}
    parts = ["<h2>Metric curves</h2>",
             f"<p class=\"muted\">Exact values recorded on rank {curves.rank}" + (
                 ", run A (solid) and run B (dashed); beside each metric's chart, its |A − B| on a log scale."
                 if curves.b is not None else ".") + "</p>"]
    notes = []
    charts = []
    for name in sorted(ma):
        a, b = ma[name], mb.get(name, {})
        marks = []
        parting = _first_parting(a, b) if b else None
        if parting is not None:
            marks.append((parting, f"{name} parts", "#c62828"))
            notes.append(f"<b>{e(name)}</b> first differs at step {parting}")
        if trace_step is not None and (parting is None or trace_step < parting):
            marks.append((trace_step, "trace parts", ORIGIN))
        series = [("A", a, _ARM_COLORS[0], False)] + ([("B", b, _ARM_COLORS[1], True)] if b else [])
        charts.append(line_chart(name, series, marks=marks))
        if b:
            delta = {s: abs(a[s] - b[s]) for s in a.keys() & b.keys()}
            charts.append(line_chart(f"|A − B| of {name}", [("|A − B|", delta, "#c62828", False)], marks=marks,
                                     log=True))
    if curves.b is not None:
        summary = "; ".join(notes) if notes else "no metric differs between the two runs"
        if trace_step is not None:
            summary += f"; the trace itself first differs at step {trace_step}"
        parts.append(f"<p>{summary}.</p>")
    parts.append('<div class="charts">' + "".join(charts) + "</div>")
    return parts


def _path_section(ladder: LocateResult) -> list[str]:
    stages = {s.rung: s for s in ladder.stages}
    items = []
    semantic = stages.get("semantic")
    broad = semantic.found if semantic else None
    if semantic and broad:
        ranks = (semantic.diff or {}).get("origin_ranks") or [broad.rank]
        items.append(f"<li>step <b>{e(broad.step)}</b>, origin rank(s) <b>{e(', '.join(map(str, ranks)))}"
                     f"</b>: the first record that differs between the two broad runs is "
                     f"<code>{e(broad.name)}</code> ({e(broad.phase)}, {e(broad.role)}).</li>")
    module = stages["module"].found if "module" in stages else None
    if module:
        items.append(f"<li>phase <b>{e(module.phase)}</b>, module <b>{e(scope_label(module.module))}"
                     f"</b>: first {'origin' if module.origin else 'divergent'} module record "
                     f"<code>{e(module.name)}</code> ({e(module.role)}).</li>")
    op = stages["op"].found if "op" in stages else None
    if op:
        items.append(f"<li>op <b>{e(op.name)}</b> in <b>{e(scope_label(op.module))}</b>, "
                     f"{e(op.phase)} of step {e(op.step)} on rank {e(op.rank)}: "
                     + ("its inputs were equal and its output differed (origin)." if op.origin else
                        "its inputs already differed (receiver).") + "</li>")
    parts = ["<h2>Narrowing path</h2>"]
    if not items:
        return [*parts, '<p class="muted">Nothing to narrow: the runs did not part.</p>']
    parts.append('<ol class="path">' + "".join(items) + "</ol>")
    for stage in ladder.stages:
        if stage.note and stage.rung in ("module", "op") and not stage.found:
            parts.append(f"<p class=\"muted\">{e(stage.note)}.</p>")
    if ladder.culprit_records:
        rows = [[e(r.role), e(r.index), f'<span class="mono">{e(r.shape)}</span>', e(r.dtype), e(r.numel),
                 '<span class="same">equal</span>' if r.equal else '<span class="differ">differs</span>']
                for r in ladder.culprit_records]
        parts.append("<p>The culprit call in the two op-rung runs:</p>")
        parts.append(_table(["role", "index", "shape", "dtype", "numel", "A vs B"], rows, raw=True))
    return parts


def _replay_section(replay: ReplayResult | None, stages: tuple[Stage, ...]) -> list[str]:
    parts = ["<h2>Kernel rung: replay of the culprit</h2>"]
    kernel = next((s for s in stages if s.rung == "kernel"), None)
    if replay is None:
        note = kernel.note if kernel else "the ladder did not reach the kernel rung"
        return [*parts, f"<p class=\"muted\">{e(note)}.</p>"]
    verdict = "nondeterministic" if replay.nondeterministic else "deterministic"
    base = replay.base
    parts.append(f"<p><code>{e(replay.op)}</code> replayed alone on its captured inputs is "
                 f"<span class=\"badge {verdict}\">{verdict}</span> with {base.threads} thread(s) and "
                 f"deterministic algorithms {'on' if base.deterministic else 'off'}: "
                 f"{base.repeats} repeats, up to {base.differing_elements} differing elements, "
                 f"up to {base.max_ulp} ULP apart.</p>")
    if replay.nondeterministic:
        fixes = replay.fixed_by
        parts.append("<p>Fixed by: " + (", ".join(f"<code>{e(f)}</code>" for f in fixes) if fixes
                                        else "none of the switches tried") + "</p>")
    shapes = ", ".join(f"{s['role']} {s['dtype']}{s['shape']}" for s in replay.shapes)
    if shapes:
        parts.append(f"<p class=\"muted mono\">{e(shapes)}</p>")
    rows = [[str(a.threads), "on" if a.deterministic else "off", str(a.repeats), str(a.distinct),
             str(a.differing_elements), str(a.max_ulp), a.note(base)] for a in replay.arms]
    parts.append(_table(["threads", "deterministic algorithms", "repeats", "distinct outputs", "differing elements",
                         "max ULP", "note"], rows))
    return parts


def render_locate(ladder: LocateResult, curves: Curves, spread: dict[int, dict[int, tuple[int, int]]]) -> str:
    """The report of a locate directory: its ladder, the broad pair's metric curves and where their records differ
    (`detrace.analyze.pairs.divergence_map`)."""
    verdict = ladder.verdict
    body = [f"<h1>detrace locate <span class=\"badge {e(verdict)}\">{e(verdict)}</span></h1>",
            f"<p class=\"answer\">{e(ladder.message)}</p>",
            f"<p class=\"muted\">command: <code>{e(' '.join(ladder.command))}</code> · "
            f"{len(ladder.runs)} runs · {ladder.steps} steps recorded</p>"]
    culprit = ladder.culprit
    if culprit:
        body.append("<h2>Culprit</h2>" + _table(
            ["rank", "step", "phase", "module", "name", "origin"],
            [[str(culprit.rank), str(culprit.step), str(culprit.phase), scope_label(culprit.module),
              str(culprit.name), str(culprit.origin).lower()]], anywhere=(3, 4)))
    if ladder.notes:  # what the terminal prints as `note` (the audit's prediction among them)
        body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(note)}</li>" for note in ladder.notes) + "</ul>")
    first = ladder.stages[0].found
    body += _metric_section(curves, first.step if first else None)
    body.append("<h2>Where the runs differ, rank by rank</h2>")
    body.append("<p class=\"muted\">Records of the two broad runs aligned by identity; each cell is one step of "
                "one rank. Gray: every record equal; orange to red: the share of records that differ; ringed: the "
                "first divergent record.</p>")
    body.append('<p class="legend"><span><i class="sw" style="background:#dfe3e8"></i>equal</span>'
                '<span><i class="sw" style="background:rgb(245,160,60)"></i>a few records differ</span>'
                '<span><i class="sw" style="background:rgb(183,28,40)"></i>all records differ</span>'
                f'<span><i class="sw" style="border:2px solid {ORIGIN}"></i>first divergence</span></p>')
    body.append(spread_map(spread, origin=(first.rank, first.step) if first else None, steps=max(ladder.steps, 1)))
    body += _path_section(ladder)
    body += _replay_section(ladder.replay, ladder.stages)
    body.append("<h2>Runs</h2>")
    body.append(_table(["rung", "steps", "ranks", "run directory", "what it established"],
                       [[s.rung, s.steps, s.ranks, run, s.note] for s in ladder.stages for run in s.runs],
                       anywhere=(3,)))
    body.append(f"<p class=\"muted\">Written by detrace from {e(ladder.out)}.</p>")
    return _page(f"detrace locate: {verdict}", body)


def render_run(run_dir: Path, info: RunInfo, traces: list[RankTrace], curves: Curves) -> str:
    """The report of a single run directory: its metric curves and what each rank recorded."""
    header = info.header
    body = [f"<h1>detrace run <span class=\"badge run\">{e(header.rung or 'trace')}</span></h1>",
            f"<p class=\"muted\">{e(run_dir)} · world size {info.world_size}</p>"]
    if header.command:
        body.append(f"<p>command: <code>{e(' '.join(header.command))}</code></p>")
    body += _metric_section(curves, None)
    rows = [[str(trace.rank), str(trace.table.num_rows), str(trace.last_step + 1),
             "complete" if trace.complete else (trace.detail or "ended early (no footer)")] for trace in traces]
    body.append("<h2>Ranks</h2>" + _table(["rank", "records", "steps", "state"], rows))
    return _page(f"detrace run: {run_dir.name}", body)


_VARIANT_COLORS = ("#2e7d32", "#6a1b9a", "#ef6c00", "#00838f", "#ad1457", "#5d4037")


def render_ablate(result: dict[str, Any]) -> str:
    """The report of a `detrace ablate` directory, from its ablate.json (schema detrace.ablate/1): the verdict,
    and per variant a chart of the metric around S against the baseline and the original run."""
    step, metric, threshold = result["step"], result["metric"], result.get("threshold")
    verdict = result["verdict"]
    badge = {"isolated": "nondeterministic", "no-spike": "deterministic"}.get(verdict, "inconclusive")
    body = [f"<h1>detrace ablate <span class=\"badge {badge}\">{e(verdict)}</span></h1>",
            f"<p class=\"answer\">{e(result['summary'])}</p>",
            f"<p class=\"muted\">spike at step {e(step)} of <code>{e(metric)}</code> in {e(result['run'])}; "
            f"threshold {e(f'{threshold:.6g}' if threshold is not None else '-')} (median + {e(result['k'])} x MAD "
            f"of the {e(result['window'])} steps before); replays from the checkpoint after {e(result['checkpoint'])} "
            f"steps; cost {e(result['cost']['runs'])} runs, {e(result['cost']['steps'])} steps, "
            f"{e(result['cost']['seconds'])} s</p>"]
    if result.get("command"):
        body.append(f"<p>command: <code>{e(' '.join(result['command']))}</code></p>")
    rows = [[v["name"], v["change"], str(v["at"]), "-" if v["value"] is None else f"{v['value']:.6g}",
             "yes" if v["spiked"] else "no",
             "-" if v["effect"] is None else f"{v['effect']:+.4g}",
             "identical" if v["departure"] is None else
             f"step {v['departure']['step']}, {v['departure']['phase']} {v['departure']['name']}"
             + (f" in {v['departure']['module']}" if v["departure"]["module"] else "")]
            for v in result.get("variants", [])]
    if rows:
        body.append("<h2>Variants, by their effect on the spike</h2>"
                    + _table(["variant", "change", "its step S", metric, "spikes", "vs baseline", "first departure"],
                             rows))

    def series(data: dict[str, float], shift: int = 0) -> dict[int, float]:
        return {int(t) + shift: v for t, v in data.items()}

    base = result.get("baseline") or {}
    original = series(result.get("original_series", {}))
    marks = [(step, "S", ORIGIN)]
    charts = []
    lines = [("original", original, "#9aa4b0", True)] if original else []
    lines.append(("baseline", series(base.get("series", {})), _ARM_COLORS[0], False))
    if threshold is not None:
        lines.append(("threshold", {step - 1: threshold, step + 1: threshold}, "#c62828", True))
    charts.append(line_chart(f"{metric}: baseline replay", lines, marks=marks))
    for i, variant in enumerate(result.get("variants", [])):
        shift = step - variant["at"]  # drawn at the baseline's steps: the batch of S lines up with S
        label = variant["name"] + (f" (steps +{shift})" if shift else "")
        charts.append(line_chart(f"{metric}: {variant['name']}", [
            ("baseline", series(base.get("series", {})), _ARM_COLORS[0], True),
            (label, series(variant["series"], shift), _VARIANT_COLORS[i % len(_VARIANT_COLORS)], False)],
            marks=marks))
    body.append("<h2>The metric around S</h2><div class=\"charts\">" + "".join(charts) + "</div>")
    return _page(f"detrace ablate: step {step}", body)


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML report of a run or locate directory to `out` (default `<path>/report.html`).

    This is where the report reads: the ladder record, and from the trace files the analysis the pages draw.
    """
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a run or locate directory")
    if (path / ABLATE_FILE).exists():
        try:
            page = render_ablate(json.loads((path / ABLATE_FILE).read_text()))
        except (OSError, ValueError, KeyError) as err:
            raise TraceError(f"{path / ABLATE_FILE} is not a readable detrace.ablate/1 record: {err}") from None
    elif (path / LADDER_FILE).exists():
        ladder = load_ladder(path)
        run_a, run_b = (Path(p) for p in ladder.stages[0].runs[:2])
        page = render_locate(ladder, Curves.read(run_a, run_b), divergence_map(run_a, run_b))
    elif rank_trace_paths(path) or run_header_path(path).exists():
        info = open_run(path)
        page = render_run(path, info, [read_rank(path, rank) for rank in info.ranks], Curves.read(path))
    else:
        raise TraceError(f"{path} is neither a run directory ({RANK_GLOB}) nor a locate directory ({LADDER_FILE})")
    target = Path(out) if out is not None else path / REPORT_FILE
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page, encoding="utf-8")
    except OSError as err:
        raise TraceError(f"cannot write the report to {target}: {err.strerror}") from None
    return target
