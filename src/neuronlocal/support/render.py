"""Support matrix output: markdown table, one static HTML page (sortable, filterable, with a
bar chart by status drawn as inline SVG, so it opens offline) and README's summary block.

Every number on every page comes from the JSON's `summary` (matrix.summary) through
`headline()`, so README, markdown and HTML cannot state different counts.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from neuronlocal.core.charts import COLORS, bar_chart
from neuronlocal.core.files import write_private
from neuronlocal.support.models import MODES

STATUS_MEANING = {
    "pass": "runs on neuron and matches CPU in every mode that runs on CPU",
    "neuron-fail": "fails or differs on neuron in a mode that runs on CPU",
    "cpu-fail": "fails on CPU in every mode, so there is nothing to compare",
    "build-fail": "the tiny model could not be built (config or class), nothing ran",
    "skipped": "not run: a missing optional package, or past the memory bound",
    "timeout": "no result within the time limit",
    "crash": "the worker process died",
    "not-run": "not run yet: the sweep stopped before this row (a rerun resumes and fills it)",
}
README_START = "<!-- support-summary:start -->"
README_END = "<!-- support-summary:end -->"


def headline(data: dict[str, Any]) -> str:
    """The one sentence of counts, used verbatim on every page."""
    s = data["summary"]
    c = s["counts"]
    untested = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("pass", "neuron-fail"))
    return (f"{s['total']} {data['task']} architectures of transformers "
            f"{data.get('transformers', '?')}: {s['tested']} tested on CPU and neuron, "
            f"{s['passed']} pass in every mode ({s['pass_rate_of_tested']:.1%} of those "
            f"tested), {c.get('neuron-fail', 0)} fail on neuron; {s['untested']} untested"
            + (f" ({untested})" if untested else "") + ".")


def _mode_cell(row: dict[str, Any], mode: str) -> str:
    m = row.get("modes", {}).get(mode)
    if not m:
        return "-"
    if not m.get("cpu_ok"):
        return "cpu-fail" if not (m.get("error") or "").startswith("unsupported") else "n/a"
    cell = "ok" if m.get("neuron_ok") else "FAIL"
    return f"{cell} ({m['graphs']}g)" if mode == "shapes" and m.get("graphs") else cell


def _error(row: dict[str, Any]) -> str:
    """The row's error, or the first mode's (a cpu-fail row carries it per mode)."""
    if row.get("error"):
        return str(row["error"])
    for m in row.get("modes", {}).values():
        if m.get("error"):
            return str(m["error"])
    return ""


def _timing(data: dict[str, Any]) -> str:
    s, run = data["summary"], data.get("run") or {}
    per_mode = ", ".join(f"{k} {v / 60:.1f}" for k, v in s.get("mode_seconds", {}).items())
    wall = (f"sweep {run.get('wall_seconds', 0) / 60:.1f} min wall with -j {run['jobs']} "
            f"for {run.get('rows_run', 0)} rows; " if run.get("jobs") else "")
    reran = sorted({m for r in run.get("reruns", []) for m in r.get("models", [])})
    if reran:
        wall += f"rerun since: {', '.join(reran)}; "
    return (f"Time: {wall}rows {s.get('row_seconds', 0) / 60:.1f} min in total; per mode (min): "
            f"{per_mode or '-'}. Host emulation times, not Trainium timings.")


def _untested(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(r["model_type"], r["status"], _error(r).splitlines()[0] if _error(r) else "")
            for r in data["models"] if r["status"] not in ("pass", "neuron-fail")]


def markdown(data: dict[str, Any]) -> str:
    s = data["summary"]
    head = ["model type", "architecture", "status", *MODES, "layers", "seconds", "compiles",
            "peak HBM MiB", "fallback ops", "fallbacks", "error"]
    lines = [f"# Model support matrix: {data['task']}", "", headline(data), "",
             "Status counts: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items()), "",
             _timing(data), "",
             "Statuses: " + "; ".join(f"**{k}** {v}" for k, v in STATUS_MEANING.items()) + ".",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["models"]:
        err = _error(r).replace("|", "\\|").replace("\n", " ")[:120]
        fb = ", ".join(r.get("fallback_ops") or {}) or "-"
        lines.append(
            f"| {r['model_type']} | {r['architecture']} | {r['status']} | "
            + " | ".join(_mode_cell(r, m) for m in MODES)
            + f" | {r.get('layers') or '-'} | {r.get('seconds', 0):.0f} | "
            f"{r.get('compiles', 0)} | {r.get('peak_hbm', 0) / 2**20:.1f} | "
            f"{len(r.get('fallback_ops') or {})} | {fb} | {err} |")
    untested = _untested(data)
    if untested:
        lines += ["", "## Untested architectures", ""]
        lines += [f"- **{mt}** ({st}): {why.replace('|', '/')[:300]}" for mt, st, why in untested]
    return "\n".join(lines) + "\n"


def _status_chart(counts: dict[str, int]) -> str:
    bars = [(status, float(n), COLORS.get(status, COLORS["slate"]))
            for status, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return bar_chart(bars, "models by status", width=520, digits=0)


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
    head = ["model type", "architecture", "status", *MODES, "layers", "seconds", "compiles",
            "peak HBM MiB", "fallback ops", "fallbacks", "error"]
    ths = "".join(f'<th onclick="sortBy({i})">{h}</th>' for i, h in enumerate(head))
    body = []
    for r in data["models"]:
        color = COLORS.get(r["status"], COLORS["slate"])
        cells = [html.escape(r["model_type"]), html.escape(r["architecture"]),
                 f'<b style="color:{color}">{r["status"]}</b>',
                 *(_mode_cell(r, m) for m in MODES), str(r.get("layers") or "-")]
        tds = "".join(f"<td>{c}</td>" for c in cells)
        fb = r.get("fallback_ops") or {}
        tds += (f'<td data-v="{r.get("seconds", 0):.1f}">{r.get("seconds", 0):.0f}</td>'
                f'<td>{r.get("compiles", 0)}</td>'
                f'<td data-v="{r.get("peak_hbm", 0)}">{r.get("peak_hbm", 0) / 2**20:.1f}</td>'
                f'<td>{len(fb)}</td><td>{html.escape(", ".join(fb) or "-")}</td>'
                f'<td class="e">{html.escape(_error(r)[:300])}</td>')
        body.append(f"<tr>{tds}</tr>")
    legend = "".join(f"<li><b>{k}</b>: {html.escape(v)}</li>" for k, v in STATUS_MEANING.items())
    untested = "".join(f"<li><b>{html.escape(mt)}</b> ({st}): {html.escape(why[:300])}</li>"
                       for mt, st, why in _untested(data))
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>neuronlocal support matrix: {data['task']}</title>
<style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ddd;padding:3px 6px}}th{{cursor:pointer;background:#f2f2f2}}
td.e{{max-width:420px;font-size:11px;color:#555}}</style><script>{_SCRIPT}</script></head><body>
<h1>Does it run on Trainium? {data['task']} architectures</h1>
<p>{html.escape(headline(data))}</p>
<p>Each model: a tiny random config that keeps the architecture's layer kinds, then every
mode compared with CPU: {', '.join(MODES)} (shapes: the compiled model's forward + backward
at a second size under the default Dynamo config, which recompiles with symbolic sizes;
compiled modes count their graphs). {html.escape(_timing(data))}</p>
{_status_chart(s['counts'])}
<ul>{legend}</ul>
<p><input id="q" placeholder="filter" oninput="filt()"></p>
<table id="m"><thead><tr>{ths}</tr></thead><tbody>{''.join(body)}</tbody></table>
{f'<h2>Untested architectures</h2><ul>{untested}</ul>' if untested else ''}
</body></html>
"""


def write_all(out_dir: Path, task: str, data: dict[str, Any]) -> None:
    """Markdown and HTML next to the JSON (which matrix.save wrote)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_private(out_dir / f"support-{task}.md", markdown(data), mode=0o644)
    write_private(out_dir / f"support-{task}.html", html_page(data), mode=0o644)


def readme_block(support_dir: Path, root: Path) -> str:
    """README's summary of every committed matrix, generated from the JSON files."""
    lines = [README_START]
    for path in sorted(support_dir.glob("support-*.json")):
        data = json.loads(path.read_text())
        rel = path.resolve().relative_to(root.resolve())
        lines.append(f"- **{data['task']}** ([table]({rel.with_suffix('.md').as_posix()}), "
                     f"[HTML]({rel.with_suffix('.html').as_posix()})): {headline(data)}")
    lines.append(README_END)
    return "\n".join(lines)


def update_readme(readme: Path, support_dir: Path) -> bool:
    """Rewrites README's summary block from the JSON; True if it changed."""
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {README_START} ... {README_END} block")
    new = pattern.sub(lambda _: readme_block(support_dir, readme.parent), text)
    readme.write_text(new)
    return new != text
