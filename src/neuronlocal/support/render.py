"""Support matrix output: markdown table and one static HTML page (sortable, filterable,
with a bar chart by status drawn as inline SVG, so it opens offline)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from neuronlocal.support.models import MODES

COLORS = {"pass": "#2e7d32", "neuron-fail": "#c62828", "cpu-fail": "#9e9e9e",
          "unsupported": "#f9a825", "timeout": "#6a1b9a", "crash": "#4e342e"}


def _mode_cell(row: dict[str, Any], mode: str) -> str:
    m = row.get("modes", {}).get(mode)
    if not m:
        return "-"
    if not m.get("cpu_ok"):
        return "cpu-fail" if not (m.get("error") or "").startswith("unsupported") else "n/a"
    return "ok" if m.get("neuron_ok") else "FAIL"


def _error(row: dict[str, Any]) -> str:
    """The row's error, or the first mode's (a cpu-fail row carries it per mode)."""
    if row.get("error"):
        return str(row["error"])
    for m in row.get("modes", {}).values():
        if m.get("error"):
            return str(m["error"])
    return ""


def markdown(data: dict[str, Any]) -> str:
    s = data["summary"]
    lines = [f"# Model support matrix: {data['task']}", "",
             f"{s['counts'].get('pass', 0)} of {s['total']} architectures pass in every mode "
             f"that runs on CPU; pass rate among architectures that run on CPU: "
             f"**{s['pass_rate_of_cpu_runnable']:.1%}**.", "",
             "Status counts: " + ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items())),
             "", "| model type | architecture | status | " + " | ".join(MODES) +
             " | seconds | compiles | peak HBM MiB | fallbacks | error |",
             "|" + "---|" * (9 + len(MODES) - 4 + 3)]
    for r in data["models"]:
        err = _error(r).replace("|", "\\|").replace("\n", " ")[:120]
        fb = ", ".join(r.get("fallback_ops", {})) or "-"
        lines.append(
            f"| {r['model_type']} | {r['architecture']} | {r['status']} | "
            + " | ".join(_mode_cell(r, m) for m in MODES)
            + f" | {r.get('seconds', 0):.0f} | {r.get('compiles', 0)} | "
            f"{r.get('peak_hbm', 0) / 2**20:.1f} | {fb} | {err} |")
    return "\n".join(lines) + "\n"


def bar_chart(counts: dict[str, int], width: int = 520) -> str:
    total = max(sum(counts.values()), 1)
    bars, y = [], 10
    for status, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        w = int((width - 200) * n / total)
        color = COLORS.get(status, "#607d8b")
        bars.append(f'<text x="0" y="{y + 14}" font-size="13">{html.escape(status)}</text>'
                    f'<rect x="110" y="{y}" width="{w}" height="18" fill="{color}"/>'
                    f'<text x="{115 + w}" y="{y + 14}" font-size="13">{n}</text>')
        y += 26
    return f'<svg width="{width}" height="{y + 6}" role="img">{"".join(bars)}</svg>'


_SCRIPT = """
function sortBy(i){const t=document.getElementById('m');const rows=[...t.tBodies[0].rows];
const asc=t.dataset.col==i&&t.dataset.dir!='asc';t.dataset.col=i;t.dataset.dir=asc?'asc':'desc';
rows.sort((a,b)=>{const x=a.cells[i].dataset.v??a.cells[i].innerText,
y=b.cells[i].dataset.v??b.cells[i].innerText;const nx=parseFloat(x),ny=parseFloat(y);
const c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;});
rows.forEach(r=>t.tBodies[0].appendChild(r));}
function filt(){const q=document.getElementById('q').value.toLowerCase();
for(const r of document.getElementById('m').tBodies[0].rows){
r.style.display=r.innerText.toLowerCase().includes(q)?'':'none';}}
"""


def html_page(data: dict[str, Any]) -> str:
    s = data["summary"]
    head = ["model type", "architecture", "status", *MODES, "seconds", "compiles",
            "peak HBM MiB", "fallbacks", "error"]
    ths = "".join(f'<th onclick="sortBy({i})">{h}</th>' for i, h in enumerate(head))
    body = []
    for r in data["models"]:
        color = COLORS.get(r["status"], "#607d8b")
        cells = [html.escape(r["model_type"]), html.escape(r["architecture"]),
                 f'<b style="color:{color}">{r["status"]}</b>',
                 *(_mode_cell(r, m) for m in MODES)]
        tds = "".join(f"<td>{c}</td>" for c in cells)
        tds += (f'<td data-v="{r.get("seconds", 0):.1f}">{r.get("seconds", 0):.0f}</td>'
                f'<td>{r.get("compiles", 0)}</td>'
                f'<td data-v="{r.get("peak_hbm", 0)}">{r.get("peak_hbm", 0) / 2**20:.1f}</td>'
                f'<td>{html.escape(", ".join(r.get("fallback_ops", {})) or "-")}</td>'
                f'<td class="e">{html.escape(_error(r)[:300])}</td>')
        body.append(f"<tr>{tds}</tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>neuronlocal support matrix: {data['task']}</title>
<style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ddd;padding:3px 6px}}th{{cursor:pointer;background:#f2f2f2}}
td.e{{max-width:420px;font-size:11px;color:#555}}</style><script>{_SCRIPT}</script></head><body>
<h1>Does it run on Trainium? {data['task']} architectures</h1>
<p>{s['counts'].get('pass', 0)} of {s['total']} pass; pass rate among architectures that run on
CPU: <b>{s['pass_rate_of_cpu_runnable']:.1%}</b>. Each model: tiny random config, eager
forward+backward, compiled forward (backend neuron), static-cache generate, one AdamW step,
each compared with CPU. Times are host emulation, not Trainium timings.</p>
{bar_chart(s['counts'])}
<p><input id="q" placeholder="filter" oninput="filt()"></p>
<table id="m"><thead><tr>{ths}</tr></thead><tbody>{''.join(body)}</tbody></table>
</body></html>
"""


def write_all(out_dir: Path, task: str, data: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"support-{task}.md").write_text(markdown(data))
    (out_dir / f"support-{task}.html").write_text(html_page(data))
    (out_dir / f"support-{task}.json").write_text(json.dumps(data, indent=1, default=str))
