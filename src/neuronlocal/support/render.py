"""Support matrix output: markdown table, one static HTML page (sortable, filterable, with a
bar chart by status drawn as inline SVG, so it opens offline) and README's summary block.

Every number on every page comes from the JSON's `summary` (matrix.summary) through
`headline()`, so README, markdown and HTML cannot state different counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from neuronlocal.core.charts import COLORS, bar_chart
from neuronlocal.core.files import write_private
from neuronlocal.core.pages import BASE_CSS, esc, fold
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
    """What went wrong in the row: its own error, else the error of the mode that decided its
    status (neuron failing first, then CPU). A pass row has none: a mode that does not apply
    ("unsupported: ...", shown as n/a) is not an error."""
    if row["status"] == "pass":
        return ""
    if row.get("error"):
        return str(row["error"])
    modes = [m for m in row.get("modes", {}).values() if m.get("error")]
    modes.sort(key=lambda m: (not (m.get("cpu_ok") and not m.get("neuron_ok")),
                              str(m["error"]).startswith("unsupported")))
    return str(modes[0]["error"]) if modes else ""


def _not_applicable(row: dict[str, Any], mode: str) -> str:
    """Why a mode is n/a for the row ('' when it applies)."""
    m = row.get("modes", {}).get(mode) or {}
    err = str(m.get("error") or "")
    return err.removeprefix("unsupported: ") if not m.get("cpu_ok") and \
        err.startswith("unsupported") else ""


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


def _breakable(name: str) -> str:
    """Escaped `name` that may wrap between CamelCase words and after underscores (so the
    table fits the window without breaking names at arbitrary letters)."""
    text = esc(name).replace("_", "_<wbr>")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "<wbr>", text)


def _fallbacks(ops: list[str]) -> str:
    """The first fallback op, the rest folded (one per line)."""
    if len(ops) <= 1:
        return esc(ops[0] if ops else "-")
    return fold("\n".join(ops), summary=f"{ops[0]} +{len(ops) - 1} more")


def _mode_td(row: dict[str, Any], mode: str) -> str:
    why = _not_applicable(row, mode)
    cell = _mode_cell(row, mode)
    return f'<td title="{esc(why)}">{cell}</td>' if why else f"<td>{cell}</td>"


# Fits the window: the table takes the page's width, long names wrap, errors fold to a line.
_CSS = BASE_CSS + """
table#m{width:100%}th{cursor:pointer}#m td{overflow-wrap:normal}
#m td.e,#m td.f{overflow-wrap:anywhere;font-size:12px;color:#555}#m td.e{min-width:14em}
#m td.f{min-width:10em}#m td.a{min-width:10em}"""


def html_page(data: dict[str, Any]) -> str:
    s = data["summary"]
    head = ["model type", "architecture", "status", *MODES, "layers", "seconds", "compiles",
            "peak HBM MiB", "fallback ops", "fallbacks", "error"]
    ths = "".join(f'<th onclick="sortBy({i})">{h}</th>' for i, h in enumerate(head))
    body = []
    for r in data["models"]:
        color = COLORS.get(r["status"], COLORS["slate"])
        tds = (f"<td>{_breakable(r['model_type'])}</td>"
               f"<td class='a'>{_breakable(r['architecture'])}</td>"
               f'<td><b style="color:{color}">{r["status"]}</b></td>'
               + "".join(_mode_td(r, m) for m in MODES) + f"<td>{r.get('layers') or '-'}</td>")
        fb = r.get("fallback_ops") or {}
        tds += (f'<td data-v="{r.get("seconds", 0):.1f}">{r.get("seconds", 0):.0f}</td>'
                f'<td>{r.get("compiles", 0)}</td>'
                f'<td data-v="{r.get("peak_hbm", 0)}">{r.get("peak_hbm", 0) / 2**20:.1f}</td>'
                f'<td>{len(fb)}</td><td class="f">{_fallbacks(list(fb))}</td>'
                f'<td class="e">{fold(_error(r)[:3000], limit=80)}</td>')
        body.append(f"<tr>{tds}</tr>")
    legend = "".join(f"<li><b>{k}</b>: {esc(v)}</li>" for k, v in STATUS_MEANING.items())
    untested = "".join(f"<li><b>{esc(mt)}</b> ({st}): {fold(why[:3000])}</li>"
                       for mt, st, why in _untested(data))
    return f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>neuronlocal support matrix: {data['task']}</title>
<style>{_CSS}</style><script>{_SCRIPT}</script></head><body>
<h1>Does it run on Trainium? {data['task']} architectures</h1>
<p>{esc(headline(data))}</p>
<p>Each model: a tiny random config that keeps the architecture's layer kinds, then every
mode compared with CPU: {', '.join(MODES)} (shapes: the compiled model's forward + backward
at a second size under the default Dynamo config, which recompiles with symbolic sizes;
compiled modes count their graphs; n/a: the mode does not apply, its reason on hover).
{esc(_timing(data))}</p>
{_status_chart(s['counts'])}
<ul>{legend}</ul>
<p><input id="q" placeholder="filter" oninput="filt()"> (sorting and the filter need
scripts; the table reads the same without them)</p>
<div class="scroll"><table id="m"><thead><tr>{ths}</tr></thead><tbody>{''.join(body)}</tbody>
</table></div>
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
