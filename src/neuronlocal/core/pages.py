"""Shared pieces of the static HTML pages (run report, support matrix): the base style of a
page that fills a wide window and still fits a narrow one, and long cells folded into one
line with the whole text under <details>. Plain HTML and CSS: pages open offline, no script.
"""

from __future__ import annotations

import html
from typing import Any, NamedTuple

# Fluid: the page takes 95% of the window; tables and pre blocks wrap inside it (folded text
# breaks anywhere, short cells only between words); charts scale down with their viewBox; a
# table too wide for a narrow window scrolls inside its .scroll box, never the page.
BASE_CSS = """*{box-sizing:border-box}
body{font:14px/1.4 system-ui,sans-serif;color:#222;margin:16px auto;padding:0 12px;
max-width:95vw}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0;font-size:13px;max-width:100%}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td summary,td .full{overflow-wrap:anywhere}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f8f8f8;padding:6px}
details>summary{cursor:pointer}
.full{white-space:pre-wrap;font:12px ui-monospace,monospace;color:#444;max-height:24em;
overflow:auto;margin:4px 0}
svg.chart{display:block;max-width:100%;height:auto;margin:8px 0}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,600px),1fr));
gap:0 24px}
.scroll{overflow-x:auto;max-width:100%}
.none{color:#888}.warn{color:#a15c00}
code{background:#f4f4f4;padding:1px 4px;overflow-wrap:anywhere}"""

FOLD_AT = 140  # characters: a longer (or multi-line) cell is folded to its first line


class Folded(NamedTuple):
    """A cell shown as `summary` (a terminal prints only that) that opens to `full`."""

    summary: str
    full: str

    def __str__(self) -> str:
        return self.summary


def esc(x: Any) -> str:
    return html.escape(str(x))


def one_line(text: str, limit: int = FOLD_AT) -> str:
    """The first non-empty line of `text`, cut to `limit` characters with an ellipsis."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first if len(first) <= limit else first[:limit - 1].rstrip() + "\u2026"


def fold(text: Any, summary: str | None = None, limit: int = FOLD_AT) -> str:
    """Escaped HTML of a cell: short one-line text as is; otherwise a one-line summary (the
    given one, or the text's first line) that opens to the whole text."""
    if isinstance(text, Folded):
        text, summary = text.full, text.summary
    full = str(text)
    if summary is None and "\n" not in full.strip() and len(full) <= limit:
        return esc(full)
    head = summary if summary is not None else one_line(full, limit)
    if head == full or not full:
        return esc(full)
    return (f"<details><summary>{esc(head)}</summary><div class='full'>{esc(full)}</div>"
            "</details>")
