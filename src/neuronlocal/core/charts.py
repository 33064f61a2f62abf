"""The one SVG bar chart and the one colour table of every HTML page (run report, support
matrix, estimate section): static inline SVG, no script, so pages open offline. Charts carry
a viewBox, so the page's CSS (core/pages.py) scales them down to a narrow window."""

from __future__ import annotations

import html

# Named colours; SERIES colours one line or bar per rank or core.
COLORS: dict[str, str] = {
    "blue": "#1f77b4", "red": "#d62728", "green": "#2ca02c", "orange": "#ff7f0e",
    "grey": "#999999", "slate": "#607d8b",
    # support-matrix outcomes
    "pass": "#2e7d32", "neuron-fail": "#c62828", "cpu-fail": "#9e9e9e", "build-fail": "#f9a825",
    "skipped": "#90a4ae", "timeout": "#6a1b9a", "crash": "#4e342e", "not-run": "#e0e0e0",
}
SERIES = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#17becf"]


def series_color(i: int) -> str:
    return SERIES[i % len(SERIES)]


def bar_chart(bars: list[tuple[str, float, str]], title: str, unit: str = "",
              width: int = 760, digits: int = 2) -> str:
    """Horizontal bars (label, value, colour), with the title above and each value at the
    end of its bar."""
    if not bars:
        return ""
    row, left = 18, 230
    height = 30 + row * len(bars)
    v_max = max(b[1] for b in bars) or 1.0
    suffix = f" {unit}" if unit else ""
    e = html.escape
    out = [f'<svg class="chart" width="{width}" height="{height}" role="img" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" '
           f'font-family="sans-serif" font-size="11">'
           f'<title>{e(title)}</title>'
           f'<text x="4" y="15" font-size="13" font-weight="600">{e(title)}</text>']
    for i, (label, value, color) in enumerate(bars):
        y = 24 + i * row
        w = (width - left - 80) * value / v_max
        out.append(f'<text x="{left - 6}" y="{y + 12}" fill="#555" text-anchor="end">'
                   f'{e(label[:34])}</text><rect x="{left}" y="{y}" width="{max(w, 1):.1f}" '
                   f'height="{row - 4}" fill="{color}"><title>{e(label)}: {value:.3f}{suffix}'
                   f'</title></rect><text x="{left + w + 4:.1f}" y="{y + 12}" fill="#555">'
                   f'{value:.{digits}f}{suffix}</text>')
    out.append("</svg>")
    return "".join(out)
