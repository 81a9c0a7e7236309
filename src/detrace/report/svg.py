"""The report's pictures, as inline SVG: line charts of exact metric values and the ranks x steps map of where
records differ. Plain strings, no script: the page stays one self-contained file."""

from __future__ import annotations

import html
import math
import struct
from collections.abc import Iterable

ORIGIN = "#6a1b9a"
"""The color of the first divergent record, on the map and in the page around it."""


def e(value: object) -> str:
    """`value` as escaped HTML text (quotes included, for attributes)."""
    return html.escape(str(value), quote=True)


def bits(value: float) -> str:
    """The float64's bits in hex: what the tooltips show, and what tells two values apart."""
    return "0x" + struct.pack(">d", value).hex()


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def line_chart(title: str, series: list[tuple[str, dict[int, float], str, bool]], *, marks: Iterable[
        tuple[int, str, str]] = (), log: bool = False, width: int = 480, height: int = 190) -> str:
    """An SVG line chart. series: (label, step -> value, color, dashed); marks: (step, label, color) verticals.

    With `log`, values are drawn as log10 and zeros sit on the bottom edge (labelled "0 (equal)").
    """
    left, right, top, bottom = 58, 12, 22, 28
    points = [(s, v) for _, data, _, _ in series for s, v in data.items() if math.isfinite(v)]
    marks = list(marks)
    steps = [s for s, _ in points] + [m for m, _, _ in marks]
    x_lo, x_hi = (min(steps), max(steps)) if steps else (0, 1)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1

    def transform(v: float) -> float | None:
        if not log:
            return v
        return math.log10(v) if v > 0 else None

    values = [t for _, v in points if (t := transform(v)) is not None]
    y_lo, y_hi = (min(values), max(values)) if values else (0.0, 1.0)
    if log:
        y_lo = math.floor(y_lo) - 1 if values else 0.0
        y_hi = math.ceil(y_hi) if values else 1.0
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    pad = (y_hi - y_lo) * 0.06
    y_lo, y_hi = (y_lo, y_hi) if log else (y_lo - pad, y_hi + pad)

    def px(s: float) -> float:
        return left + (s - x_lo) / (x_hi - x_lo) * (width - left - right)

    def py(t: float) -> float:
        return top + (1 - (t - y_lo) / (y_hi - y_lo)) * (height - top - bottom)

    out = [f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{e(title)}</title>',
           f'<text x="{left}" y="14" font-weight="600">{e(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
           'fill="#fbfcfd" stroke="#c9d0d8"/>']
    # log axes: whole decades only, and none on the bottom edge, where "0 (equal)" sits
    # (and none at all when every value is 0: a decade would label an axis that holds no value)
    y_ticks = [t for t in _ticks(y_lo, y_hi, 4) if not log or (values and float(t).is_integer() and t > y_lo)]
    for t in y_ticks:
        label = f"1e{round(t)}" if log else _fmt(t)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eceff3"/>'
                   f'<text x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    if log:
        out.append(f'<text x="{left - 4}" y="{height - bottom + 4}" text-anchor="end">0 (equal)</text>')
    for t in _ticks(x_lo, x_hi, 6):
        if float(t).is_integer():
            out.append(f'<text x="{px(t):.1f}" y="{height - 10}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<text x="{left - 12}" y="{height - 10}" text-anchor="end">step</text>')
    for step, label, color in marks:
        out.append(f'<line x1="{px(step):.1f}" x2="{px(step):.1f}" y1="{top}" y2="{height - bottom}" '
                   f'stroke="{color}" stroke-width="1.5" stroke-dasharray="4 3"><title>{e(label)}</title></line>')
    for label, data, color, dashed in series:
        coords = []
        for s in sorted(data):
            if not math.isfinite(data[s]):
                continue  # a NaN or infinite metric has no place on the axis; the tables show it
            t = transform(data[s])
            y = py(t) if t is not None else height - bottom
            coords.append((px(s), y, s, data[s]))
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in coords)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="{path}"/>')
        for x, y, s, v in coords:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.4" fill="{color}"><title>{e(label)} step {s}: '
                       f'{v!r} ({bits(v)})</title></circle>')
    # the marks' labels last, on a halo of the plot's colour, so that no line or point covers them; stacked when
    # two marks share a step
    for n, (step, label, color) in enumerate(marks):
        out.append(f'<text x="{px(step) + 3:.1f}" y="{top + 11 + 12 * n}" fill="{color}" style="fill:{color}" '
                   f'stroke="#fbfcfd" stroke-width="3" paint-order="stroke">{e(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def spread_map(spread: dict[int, dict[int, tuple[int, int]]], *, origin: tuple[int, int] | None,
               steps: int) -> str:
    """The ranks x steps picture: gray equal, orange to red by the share of differing records, ringed origin."""
    ranks = sorted(spread)
    cell = max(6, min(28, 860 // max(steps, 1)))
    left, top = 64, 24
    width, height = left + cell * steps + 10, top + cell * len(ranks) + 26
    out = [f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'xmlns="http://www.w3.org/2000/svg"><title>where records differ, by rank and step</title>']
    for i, rank in enumerate(ranks):
        y = top + i * cell
        out.append(f'<text x="{left - 6}" y="{y + cell / 2 + 4:.1f}" text-anchor="end">rank {rank}</text>')
        for step in range(steps):
            x = left + step * cell
            differ, total = spread[rank].get(step, (0, 0))
            if total == 0:
                fill, text = "#ffffff", "not recorded"
            elif differ == 0:
                fill, text = "#dfe3e8", f"all {total} records equal"
            else:
                share = differ / total
                # orange (few records differ) to deep red (all do), on a log scale so one record shows
                k = min(1.0, max(0.0, 1 + math.log10(max(share, 1e-3)) / 3))
                fill = f"rgb({int(245 - 62 * k)},{int(160 - 132 * k)},{int(60 - 20 * k)})"
                text = f"{differ} of {total} records differ"
            out.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{fill}" '
                       f'stroke="#c9d0d8" stroke-width="0.5"><title>rank {rank}, step {step}: {text}</title></rect>')
        if origin and origin[0] == rank:
            x = left + origin[1] * cell
            out.append(f'<rect x="{x - 1}" y="{y - 1}" width="{cell + 1}" height="{cell + 1}" fill="none" '
                       f'stroke="{ORIGIN}" stroke-width="2.5"><title>first divergent record</title></rect>')
    for step in range(steps):
        if steps <= 20 or step % max(1, steps // 10) == 0:
            out.append(f'<text x="{left + step * cell + cell / 2:.1f}" y="{top + cell * len(ranks) + 14}" '
                       f'text-anchor="middle">{step}</text>')
    out.append(f'<text x="{left}" y="14">step →</text></svg>')
    return "".join(out)
