"""``vllm-journey diff`` for people: a text table, and a page with the two
distributions side by side per phase.

Runs in the CLI's process. Figures are milliseconds (``tools/diff.py``); the
page is self-contained (inline SVG and CSS, no script, no network).
"""

from __future__ import annotations

import html

from vllm_journey_otel.tools.diff import (
    DECODE_PER_TOKEN,
    TOTALS,
    Diff,
    PhaseDiff,
    QuantileChange,
    Sample,
    phase_label,
    tail,
)

NOISE_MARK = "*"
UNRESOLVED_MARK = "?"


def _rel(c: QuantileChange) -> str:
    r = c.relative
    if r is None:
        return "new"  # from 0
    return f"x{1 + r:.0f}" if r >= 9.5 else f"{100 * r:+.0f}%"  # ten times or more: a factor


def _cell(c: QuantileChange | None) -> str:
    if c is None:
        return f"{'not observed':>30}"
    mark = UNRESOLVED_MARK if not c.resolved else NOISE_MARK if c.beyond_noise else " "
    return f"{c.base:9.1f} -> {c.new:9.1f} {_rel(c):>6}{mark}"


def _row(p: PhaseDiff, name: str | None = None) -> str:
    shift = "" if p.shift_p != p.shift_p else f"{p.shift_p:8.3g}"
    cells = "  ".join(_cell(p.at(q)) for q in (50, 90, 99))
    return f"  {(name or phase_label(p.phase)):<28} {p.base_n:>6} {p.new_n:>6}  {cells}  {shift}"


def headline(d: Diff) -> str:
    """The phase (not a total) whose tail (its highest resolved quantile) moved
    most, beyond the noise."""
    for p in d.phases:
        c = tail(p)
        if p.phase in TOTALS or c is None or not c.beyond_noise or c.change == 0:
            continue
        way = "slower" if c.change > 0 else "faster"
        return (
            f"Moved most at the highest quantile these journeys bound: {phase_label(p.phase)} "
            f"p{c.q} {c.base:.1f} -> {c.new:.1f} ms ({_rel(c)}, {way})."
        )
    return "No phase moved beyond the noise at the highest quantile these journeys bound."


def format_text(d: Diff, base_name: str, new_name: str, failures: list[str]) -> str:
    lines = [
        f"base {base_name}: {d.base.count} journeys; new {new_name}: {d.new.count} journeys",
        headline(d),
        *(f"note: {n}" for n in d.notes),
        f"  {'phase (ms)':<28} {'n base':>6} {'n new':>6}  "
        + "  ".join(f"{f'p{q} base -> new':>30}" for q in (50, 90, 99))
        + "  shift p",
    ]
    lines += [_row(p) for p in d.phases]
    for dim, values in d.groups.items():
        lines.append(f"by {dim}:")
        for value, phases in values.items():
            lines += [_row(p, f"{value or '(none)'}: {phase_label(p.phase)}") for p in phases]
    lines.append(
        f"{NOISE_MARK} beyond the noise: the two files' 95% intervals of that quantile "
        f"(order statistics) are apart; {UNRESOLVED_MARK} too few journeys to bound that "
        "quantile. shift p: Mann-Whitney U test of the whole distribution. "
        f"{phase_label(DECODE_PER_TOKEN)}: ms per output token after the first."
    )
    lines += [f"FAILED {f}" for f in failures]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The page: per phase, both files' quantile curves on one axis
# ---------------------------------------------------------------------------
W, H, PAD = 420, 170, 34
_STYLE = """
body{font:13px system-ui,sans-serif;margin:18px;color:#222}
h1{font-size:18px}.grid{display:flex;flex-wrap:wrap;gap:14px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px}
.card h2{font-size:14px;margin:0 0 4px}.base{stroke:#7a7a7a}.new{stroke:#e8590c}
table{border-collapse:collapse;font-size:12px}td,th{padding:1px 6px;text-align:right}
.beyond{font-weight:bold;color:#c92a2a}.legend span{display:inline-block;width:18px;height:3px;
margin:0 4px 3px 10px}
"""


def _curve(values: list[float], top: float, cls: str) -> str:
    if not values:
        return ""
    n = len(values)
    step = max(1, n // 200)
    idx = [*range(0, n, step), n - 1]
    pts = " ".join(
        f"{PAD + (W - PAD - 6) * i / max(1, n - 1):.1f},"
        f"{H - PAD + 14 - (H - PAD) * values[i] / top:.1f}"
        for i in idx
    )
    return f'<polyline class="{cls}" fill="none" stroke-width="2" points="{pts}"/>'


def _svg(base: list[float], new: list[float]) -> str:
    top = max(base[-1] if base else 0.0, new[-1] if new else 0.0) or 1.0
    y0 = H - PAD + 14
    axes = (
        f'<line x1="{PAD}" y1="{y0}" x2="{W - 6}" y2="{y0}" stroke="#999"/>'
        f'<line x1="{PAD}" y1="14" x2="{PAD}" y2="{y0}" stroke="#999"/>'
        f'<text x="{PAD - 4}" y="18" text-anchor="end" font-size="10">{top:.4g}</text>'
        f'<text x="{PAD - 4}" y="{y0}" text-anchor="end" font-size="10">0</text>'
        f'<text x="{W - 6}" y="{y0 + 14}" text-anchor="end" font-size="10">quantile 1.0</text>'
        f'<text x="{PAD}" y="{y0 + 14}" font-size="10">0</text>'
    )
    return (
        f'<svg width="{W}" height="{H + 8}" role="img">{axes}'
        f"{_curve(base, top, 'base')}{_curve(new, top, 'new')}</svg>"
    )


def _table(p: PhaseDiff) -> str:
    rows = "".join(
        f"<tr><td>p{c.q}</td><td>{c.base:.2f}</td><td>{c.new:.2f}</td>"
        f'<td class="{"beyond" if c.beyond_noise else ""}">{html.escape(_rel(c))}'
        f"{'' if c.resolved else ' ' + UNRESOLVED_MARK}</td></tr>"
        for c in p.quantiles
    )
    return (
        f"<table><tr><th></th><th>base</th><th>new</th><th>change</th></tr>{rows}"
        f"<tr><td>n</td><td>{p.base_n}</td><td>{p.new_n}</td><td></td></tr></table>"
    )


def render_html(d: Diff, base: Sample, new: Sample, base_name: str, new_name: str) -> str:
    cards = []
    for p in d.phases:
        b, n = base.sorted_values(p.phase), new.sorted_values(p.phase)
        cards.append(
            f'<div class="card" data-phase="{html.escape(p.phase)}">'
            f"<h2>{html.escape(phase_label(p.phase))} (ms)</h2>{_svg(b, n)}{_table(p)}</div>"
        )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>vllm-journey diff</title>"
        f"<style>{_STYLE}</style></head><body><h1>vllm-journey diff</h1>"
        f"<p class='legend'><span style='background:#7a7a7a'></span>base "
        f"{html.escape(base_name)} ({d.base.count} journeys)"
        f"<span style='background:#e8590c'></span>new {html.escape(new_name)} "
        f"({d.new.count} journeys)</p><p>{html.escape(headline(d))} Each curve: the "
        "phase's values in order (the quantile function); bold change: beyond the noise; "
        f"{UNRESOLVED_MARK}: too few journeys to bound that quantile.</p>"
        f"<div class='grid'>{''.join(cards)}</div></body></html>"
    )
