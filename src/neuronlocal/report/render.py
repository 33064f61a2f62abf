"""Renderings of a run report: terminal summary (rich), JSON, and one static HTML page.

The HTML page is self-contained and works offline: no scripts, charts drawn as inline SVG
here. Every renderer takes the merged form `{"ranks": [rank report, ...]}` (see
`merge`), so a single process and a torchrun job are shown the same way.
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from neuronlocal.core.charts import COLORS, bar_chart, series_color
from neuronlocal.core.pages import BASE_CSS, Folded, esc, fold, one_line
from neuronlocal.core.units import fmt_bytes
from neuronlocal.estimate import view as estimate_view


def merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several ranks (each rank's data kept whole, sorted by rank)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    world = max([r.get("world_size", 1) for r in ranks] + [len(ranks)])
    codes = [r["run"].get("exit_code") for r in ranks]
    return {"schema": ranks[0]["schema"] if ranks else 1, "world_size": world,
            "complete": len(ranks) >= world, "exit_code": max((c or 0) for c in codes) if codes
            else 0, "ranks": ranks}


def _site(e: dict[str, Any]) -> str:
    return f"{e['file']}:{e['line']}" if e.get("file") else "(not captured)"


def _break_reason(b: dict[str, Any]) -> str:
    """A graph break's kind, and whether its whole function then ran eagerly."""
    return b["reason"] + ("; the whole function ran eagerly" if b.get("whole_function_eager")
                          else "")


def per_call(f: dict[str, Any]) -> str:
    """Bytes a host fallback copies to the host and back, per call (its cost on Trainium)."""
    n = max(1, f["count"])
    to_host, from_host = f.get("to_host_bytes", 0) / n, f.get("from_host_bytes", 0) / n
    return f"{fmt_bytes(to_host)} / {fmt_bytes(from_host)}"


def _shapes(shapes: list[Any]) -> str:
    text = ", ".join("x".join(str(n) for n in s) or "scalar" for s in shapes)
    return text if len(text) <= 60 else text[:57] + "..."


def dtypes_summary(dtypes: list[str]) -> str:
    """['torch.int64', 19 x 'torch.float32'] -> 'int64, 19 x float32' (first-seen order)."""
    counts: dict[str, int] = {}
    for d in dtypes:
        name = d.removeprefix("torch.")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in counts.items())


def cache_line(rep: dict[str, Any]) -> str:
    """The compile cache's hit rate over every rank's graphs."""
    graphs = [g for r in rep["ranks"] for g in r["graphs"]]
    if not graphs:
        return "compile cache: no graphs compiled"
    hits = sum(g["cache"] == "hit" for g in graphs)
    return (f"compile cache: {hits}/{len(graphs)} graphs were hits "
            f"({hits / len(graphs):.0%}), {len(graphs) - hits} compiled")


def ranks_label(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> 'ranks 0-3, 6'; [2] -> 'rank 2'."""
    runs: list[list[int]] = []
    for n in sorted(ranks):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


# Device and rank numbers differ between ranks that hit the same error.
_PER_RANK = re.compile(r"\b(neuron|cuda|cpu|rank|device|core)([ :=_]?)\d+", re.I)
_FAILED_GRAPH = re.compile(r"could not compile graph '([^']+)'")
_COMPILE_FAILURE = ("NEFFCompilationError", "BackendCompilerFailed")
_LIBRARY_FRAME = re.compile(r"site-packages|dist-packages|/neuronlocal/|<frozen |/torch/")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _same_everywhere(text: str) -> str:
    return _PER_RANK.sub(r"\1\2N", text)


def failing_graph(r: dict[str, Any]) -> str | None:
    """The graph a compile failure names, or the one being compiled when it failed."""
    err = r["run"].get("error") or {}
    text = f"{err.get('message', '')}\n{err.get('traceback', '')}"
    if m := _FAILED_GRAPH.search(text):
        return m.group(1)
    if not any(k in text or k == err.get("type") for k in _COMPILE_FAILURE):
        return None
    done = [g["graph_name"] for g in r.get("graphs", [])]
    return (f"the graph compiled after {done[-1]} (the last that compiled)" if done
            else "the first graph compiled")


def user_frame(traceback_text: str) -> str:
    """'file:line in function' of the innermost frame of the user's code, or ''."""
    frames = [m for m in _FRAME.finditer(traceback_text)
              if not _LIBRARY_FRAME.search(m.group(1))]
    return f"{frames[-1].group(1)}:{frames[-1].group(2)} in {frames[-1].group(3)}" \
        if frames else ""


def _rank_findings(r: dict[str, Any]) -> list[str]:
    """One rank's short findings, worst first, without a rank prefix."""
    out = []
    err = r["run"].get("error")
    ended = str(r["run"].get("ended_by", ""))
    if err and (ended.startswith("killed") or ended.startswith("exit ")):
        out.append(str(err["message"]))
    elif err:
        first = one_line(str(err["message"]), 300)
        graph = failing_graph(r)
        out.append(f"the script raised {err['type']}" + (f": {first}" if first else "")
                   + (f" (failing graph: {graph})" if graph and graph not in first else ""))
    elif ended == "os._exit":
        out.append(f"the script ended with os._exit({r['run'].get('exit_code')})")
    if r.get("config_error"):
        out.append(str(r["config_error"]))
    if r["recompiles"]:
        hint = "; see the bucket suggestion" if r["bucket_suggestions"] else ""
        out.append(f"{len(r['recompiles'])} recompilation(s){hint}")
    if r["fallback_ops"]:
        n = sum(f["count"] for f in r["fallback_ops"])
        out.append(f"{len(r['fallback_ops'])} op(s) ran on the host CPU ({n} calls)")
    if r["graph_breaks"]:
        eager = sum(b["count"] for b in r["graph_breaks"] if b.get("whole_function_eager"))
        out.append(f"{sum(b['count'] for b in r['graph_breaks'])} graph break(s)"
                   + (f", {eager} of them ran their whole function eagerly" if eager else ""))
    out += findings(r)
    return out


def findings(r: dict[str, Any]) -> list[str]:
    """A rank's recompile advice with the graph count it predicts, notes on how the run used
    its libraries, and what could not be estimated (and why)."""
    out = []
    for a in r.get("recompile_advice", []):
        todo = [f"max_cache_len={a['max_cache_len']}"] if a.get("max_cache_len") else []
        todo += [f"{name} padded to {', '.join(map(str, b))}"
                 for name, b in a.get("buckets", {}).items()]
        out.append(f"{a['function']}: {a['graphs_now']} graphs; with {' and '.join(todo)}: "
                   f"{a['graphs_predicted']} (predicted)")
    out += list(r.get("notes", []))
    out += [f"not estimated: {why}" for why in r.get("not_estimated", [])]
    return out


def headline(rep: dict[str, Any]) -> list[str]:
    """Short one-line findings, worst first (also the top of the HTML page). A finding that
    several ranks share (device numbers aside) is one line naming those ranks."""
    multi = len(rep["ranks"]) > 1
    groups: dict[str, tuple[str, list[int]]] = {}
    for r in rep["ranks"]:
        for line in _rank_findings(r):
            groups.setdefault(_same_everywhere(line), (line, []))[1].append(r["rank"])
    return [f"{ranks_label(ranks)}: {line}" if multi else line
            for line, ranks in groups.values()]


def errors(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's errors, once each: ranks that raised the same error (device numbers
    aside) share one entry, with the first of them's traceback and the failing graph."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rep["ranks"]:
        err = r["run"].get("error")
        if not err:
            continue
        key = (str(err.get("type")), _same_everywhere(str(err.get("message"))))
        entry = groups.setdefault(key, {"error": err, "ranks": [], "graph": failing_graph(r),
                                        "where": user_frame(str(err.get("traceback", "")))})
        entry["ranks"].append(r["rank"])
    return list(groups.values())


ESTIMATE = "Estimated Trainium time and cost"


@dataclass
class Section:
    """One table of the report, computed once and drawn by the terminal and HTML renderers."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    empty: str = "none"
    note: str = ""  # a paragraph under the HTML heading
    limit: int = 25  # rows shown in the terminal (the page shows them all)


def tier(graph: dict[str, Any]) -> str:
    """Which compiler ran a graph's calls: its compiler, or the tiered compiler's switch."""
    extra = graph.get("extra") or {}
    if "tier" not in extra:
        return str(extra.get("compiler", ""))
    if extra["tier"] == "inductor":
        return (f"eager, Inductor from call {extra['tier_switched_at']} "
                f"(waited {extra.get('tier_wait_s', 0):.1f} s)")
    if extra.get("tier_error"):
        return f"eager (Inductor failed: {extra['tier_error'][:80]})"
    at = extra.get("tier_switch_at")
    return f"eager (switch at call {at} not reached)" if at else "eager"


def sections(rep: dict[str, Any]) -> list[Section]:
    """Every table of the report, in page order (ESTIMATE marks where the estimate goes)."""
    ranks = rep["ranks"]
    multi = len(ranks) > 1
    rk: Callable[[dict[str, Any]], list[Any]] = \
        (lambda r: [r["rank"]]) if multi else (lambda r: [])
    rc = ["rank"] if multi else []
    return [
        Section("Compiled graphs", rc + ["graph", "kind", "nodes", "input shapes", "dtypes",
                                         "compile s", "cache", "tier"],
                [rk(r) + [g["graph_name"], g["kind"], g["node_count"],
                          _shapes(g["input_shapes"]), dtypes_summary(g["input_dtypes"]),
                          f"{g['compile_seconds']:.2f}", g["cache"], tier(g)]
                 for r in ranks for g in r["graphs"]], "no graphs compiled"),
        Section(ESTIMATE, [], []),
        Section("Recompilations", rc + ["graph", "function", "role", "kind", "cache", "cause",
                                        "Dynamo's guard"],
                [rk(r) + [e["graph"], e["function"], e.get("role", ""), e["kind"], e["cache"],
                          e["reason"], e.get("guard") or ""]
                 for r in ranks for e in r["recompiles"]], "no recompilations"),
        Section("Suggested buckets (pad to these sizes: bucketing.pad_to_bucket)",
                rc + ["function", "dimension", "sizes seen", "buckets", "graphs"],
                [rk(r) + [b["function"], f"{b.get('name') or 'input ' + str(b['input'])} "
                          f"dim {b['dim']}" + "".join(f", {x}" for x in b.get("also", [])),
                          ", ".join(map(str, b["sizes"])), ", ".join(map(str, b["buckets"])),
                          f"{b['graphs_now']} -> {b['graphs_with_buckets']}"]
                 for r in ranks for b in r["bucket_suggestions"]], "nothing to bucket",
                "Pad the dimension to the next bucket (neuronlocal.compile.bucketing."
                "pad_to_bucket): one graph per bucket instead of one per size."),
        Section("Graph breaks", rc + ["count", "reason", "where", "source", "Dynamo's hint"],
                [rk(r) + [b["count"], Folded(_break_reason(b), b.get("detail") or b["reason"]),
                          _site(b), b["source"], b.get("hint", "")]
                 for r in ranks for b in r["graph_breaks"]], "no graph breaks",
                "A break that Dynamo could not resume from runs its whole function eagerly: "
                "on Trainium, one kernel launch per op."),
        Section("CPU-fallback ops (run on the host on Trainium)",
                rc + ["op", "count", "to / from host per call", "first call site", "source"],
                [rk(r) + [f["op"], f["count"], per_call(f), _site(f), f["source"]]
                 for r in ranks for f in r["fallback_ops"]], "no CPU fallbacks",
                "On Trainium these run on the host CPU: each call copies its inputs to the "
                "host and its results back."),
        Section("Kernel layers swapped in (kernels.kernelize)",
                rc + ["model", "layer", "modules"],
                [rk(r) + [s["model"], s["layer"], s["modules"]]
                 for r in ranks for s in r.get("kernel_swaps", [])], "no layers swapped",
                "transformers kernelizes a model when `kernels` is installed (use_kernels, "
                "USE_HUB_KERNELS): these layers run neuronlocal's kernels."),
        Section("Kernel ops (NKI kernels: run on the NeuronCore)", rc + ["op", "count"],
                [rk(r) + [op, n] for r in ranks for op, n in r.get("kernel_ops", {}).items()],
                "no kernel ops"),
        Section("64-bit ops computed as 32-bit", rc + ["op", "count"],
                [rk(r) + [op, n] for r in ranks for op, n in r["downcast_ops"].items()],
                "no 64-bit downcasts", limit=10),
        Section("HBM per logical core", rc + ["core", "peak allocated", "peak reserved",
                                              "of HBM", "OOMs"],
                [rk(r) + [f"neuron:{m['core']}", fmt_bytes(m["peak_bytes"]),
                          fmt_bytes(m["reserved_peak_bytes"]),
                          f"{100 * m['peak_bytes'] / max(1, m['hbm_bytes']):.1f}% of "
                          f"{fmt_bytes(m['hbm_bytes'])}", m["num_ooms"]]
                 for r in ranks for m in r["memory"]], "no device memory used"),
        Section("Collectives", ["rank", "op", "count", "bytes"],
                [[r["rank"], x["op"], x["count"], fmt_bytes(x["bytes"])]
                 for r in ranks for x in r["collectives"]], "no collectives recorded"),
    ]


def _rich_table(c: Console, sec: Section) -> None:
    if not sec.rows:
        return
    t = Table(title=Text(sec.title), title_justify="left", show_edge=False,
              header_style="bold")
    for col in sec.columns:
        t.add_column(Text(col), overflow="fold")
    for row in sec.rows[:sec.limit]:
        t.add_row(*(Text(str(cell)) for cell in row))
    if len(sec.rows) > sec.limit:
        t.add_row(*([Text(f"... {len(sec.rows) - sec.limit} more (see report.html)")] +
                    [Text("")] * (len(sec.columns) - 1)))
    c.print(t)


PIPED_WIDTH = 200  # columns of the summary when stderr is a file or pipe (rich's default: 80)


def terminal(rep: dict[str, Any], console: Console | None = None) -> None:
    """The summary printed after a run: as wide as the terminal, or PIPED_WIDTH columns
    when stderr is not one (a log file keeps whole reasons, not 80-column fragments).

    Every string goes to rich as a Text, never as markup: argv, error messages, source
    lines and op names hold text such as `[/INST]` that rich would read as a closing tag."""
    c = console or Console(stderr=True, width=None if sys.stderr.isatty() else PIPED_WIDTH)

    def say(line: str, style: str = "") -> None:
        c.print(Text(line, style=style))

    multi = len(rep["ranks"]) > 1
    first = rep["ranks"][0]
    c.rule(Text("neuronlocal run report", style="bold"))
    say(f"script  {' '.join(map(str, first['run']['argv']))}\ninstance {first['instance']}   "
        f"ranks {len(rep['ranks'])}/{rep['world_size']}   exit status {rep['exit_code']}   "
        f"wall {max(r['run']['seconds'] for r in rep['ranks']):.1f}s\n{cache_line(rep)}")
    for line in headline(rep):
        say(f"! {line}", "yellow")

    for sec in sections(rep):
        if sec.title == ESTIMATE:
            for title, cols, rows in estimate_view.tables(rep):  # estimated Trainium time
                _rich_table(c, Section(title, cols, rows))
            for line in estimate_view.headlines(rep):
                say(line, "cyan")
        else:
            _rich_table(c, sec)
    for r in rep["ranks"]:
        ops = r["eager_ops"]
        top = ", ".join(f"{k} {v}" for k, v in list(ops.items())[:8])
        say(f"{'rank ' + str(r['rank']) + ' ' if multi else ''}eager ops: "
            f"{sum(ops.values())} calls of {len(ops)} ops" + (f" (top: {top})" if top else ""))


def text(rank_report: dict[str, Any]) -> str:
    """The terminal summary of one process as plain text (metrics.report())."""
    buf = io.StringIO()
    terminal(merge([rank_report]), Console(file=buf, width=120, no_color=True,
                                           force_terminal=False))
    return buf.getvalue()


def to_json(rep: dict[str, Any]) -> str:
    return json.dumps(rep, indent=1, default=str)


# ---- HTML -------------------------------------------------------------------------------

def line_chart(series: list[tuple[str, list[list[float]]]], title: str, limit: float | None = None,
               width: int = 760, height: int = 260) -> str:
    """Step lines of (seconds, bytes) per series, as inline SVG."""
    pts = [p for _, s in series for p in s]
    if not pts:
        return ""
    left, right, top, bottom = 70, 10, 24, 30
    t_max = max(p[0] for p in pts) or 1.0
    y_max = max(max(p[1] for p in pts), 1)
    if limit and limit <= 4 * y_max:
        y_max = max(y_max, limit)
    sx = (width - left - right) / t_max
    sy = (height - top - bottom) / y_max
    out = [f'<svg class="chart" width="{width}" height="{height}" role="img" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
           f'<title>{esc(title)}</title>',
           f'<text x="{left}" y="15" class="ct">{esc(title)}</text>']
    for k in range(5):
        y = top + (height - top - bottom) * k / 4
        v = y_max * (1 - k / 4)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'class="grid"/><text x="{left - 4}" y="{y + 4:.1f}" class="ax" '
                   f'text-anchor="end">{esc(fmt_bytes(v))}</text>')
    out.append(f'<text x="{width - right}" y="{height - 8}" class="ax" text-anchor="end">'
               f'{t_max:.2f} s</text><text x="{left}" y="{height - 8}" class="ax">0 s</text>')
    if limit and limit <= y_max:
        y = top + (height - top - bottom) * (1 - limit / y_max)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="{COLORS["red"]}" stroke-dasharray="4 3"/><text x="{width - right}" '
                   f'y="{y - 3:.1f}" class="ax" text-anchor="end">'
                   f'HBM {esc(fmt_bytes(limit))}</text>')
    for i, (label, s) in enumerate(series):
        color = series_color(i)
        path, last_y = [], None
        for t, b in [[0.0, 0]] + s:
            x, y = left + t * sx, top + (height - top - bottom) - b * sy
            path.append(f"{'M' if last_y is None else 'L'}{x:.1f},{last_y if last_y else y:.1f}")
            path.append(f"L{x:.1f},{y:.1f}")
            last_y = y
        out.append(f'<path d="{" ".join(path)}" fill="none" stroke="{color}" '
                   f'stroke-width="1.5"><title>{esc(label)}</title></path>')
        out.append(f'<text x="{left + 8 + 150 * i}" y="{height - 8}" fill="{color}" '
                   f'class="ax" dx="60">{esc(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def _table(cols: list[str], rows: list[list[Any]], empty: str = "none") -> str:
    """A table whose long or multi-line cells show one line and fold the rest."""
    if not rows:
        return f"<p class='none'>{esc(empty)}</p>"
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fold(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = BASE_CSS + "\n.grid{stroke:#eee}.ax{font-size:11px;fill:#555}.ct{font-size:13px;" \
    "font-weight:600}"


def _error_html(entry: dict[str, Any], multi: bool) -> str:
    err, ranks = entry["error"], entry["ranks"]
    facts = [f"{esc(err['type'])}: {fold(err['message'], limit=600)}"]
    if entry["graph"]:
        facts.append(f"failing graph: <b>{esc(entry['graph'])}</b>")
    if entry["where"]:
        facts.append(f"raised from <code>{esc(entry['where'])}</code>")
    if len(ranks) > 1:
        facts.append(f"the same error on {esc(ranks_label(ranks))} (device numbers aside); "
                     f"traceback of rank {ranks[0]}")
    title = f"Error ({ranks_label(ranks)})" if multi else "Error"
    tb = err.get("traceback") or ""
    return (f"<h2 id='error-{ranks[0]}'>{esc(title)}</h2><div>" + "<br>".join(facts) + "</div>"
            + (f"<details open><summary>traceback</summary><pre>{esc(tb)}</pre></details>"
               if tb else ""))


def html_page(rep: dict[str, Any], extra: str = "") -> str:
    """The whole report as one static page (inline CSS and SVG, no scripts); `extra`: a
    section (HTML) shown first, such as the dry run's."""
    ranks = rep["ranks"]
    multi = len(ranks) > 1
    first = ranks[0]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>neuronlocal run report"
             f"</title><style>{_CSS}</style></head><body><h1>neuronlocal run report</h1>",
             f"<p><code>{esc(' '.join(first['run']['argv']))}</code><br>instance "
             f"{esc(first['instance'])}; ranks {len(ranks)}/{rep['world_size']}"
             f"{'' if rep['complete'] else ' (incomplete: some ranks have not reported)'}"
             f"; exit status {rep['exit_code']}. Host emulation: compile seconds are this "
             f"machine's, not Trainium's.<br>{esc(cache_line(rep))}.</p>"]
    parts += [f"<p class='warn'>&#9888; {esc(h)}</p>" for h in headline(rep)]
    parts.append(extra)
    graphs = [(r, g) for r in ranks for g in r["graphs"]]
    recompiled = {(r["rank"], e["graph"]) for r in ranks for e in r["recompiles"]}
    parts.append("<h2>Compiled graphs</h2>")
    parts.append(bar_chart(
        [((f"r{r['rank']} " if multi else "") + g["graph_name"], g["compile_seconds"],
          COLORS["green"] if g["cache"] == "hit" else
          COLORS["red" if (r["rank"], g["graph_name"]) in recompiled else "blue"])
         for r, g in graphs[:60]],
        "compile seconds per graph (blue: first compile, red: recompile, green: cache hit)",
        unit="s", width=1200))
    coll = [(r, x) for r in ranks for x in r["collectives"]]
    for sec in sections(rep):
        if sec.title == ESTIMATE:
            parts.append(estimate_view.html(rep, _table, bar_chart, esc))
            continue
        if sec.title != "Compiled graphs":
            parts.append(f"<h2>{esc(sec.title)}</h2>")
        if sec.note:
            parts.append(f"<p>{esc(sec.note)}</p>")
        if sec.title == "Collectives":
            parts.append(bar_chart([(f"rank {r['rank']} {x['op']}", x["bytes"] / 2**20,
                                     series_color(r["rank"])) for r, x in coll],
                                   "bytes per rank and op", unit="MiB"))
        parts.append(_table(sec.columns, sec.rows, sec.empty))
        if sec.title == "HBM per logical core":
            charts = []
            for r in ranks:
                for m in r["memory"]:
                    label = (f"rank {r['rank']} " if multi else "") + f"neuron:{m['core']}"
                    charts.append(line_chart([(label, m["timeline"])],
                                             f"allocated HBM over time, {label}", m["hbm_bytes"],
                                             width=640))
            if charts:
                parts.append(f"<div class='charts'>{''.join(charts)}</div>")
    parts.append("<h2>Eager ops</h2>")
    for r in ranks:
        ops = r["eager_ops"]
        parts.append(f"<p>{'rank ' + str(r['rank']) + ': ' if multi else ''}"
                     f"{sum(ops.values())} calls of {len(ops)} ops</p>")
        parts.append(_table(["op", "count"], [[k, v] for k, v in list(ops.items())[:40]]))
    parts += [_error_html(entry, multi) for entry in errors(rep)]
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)
