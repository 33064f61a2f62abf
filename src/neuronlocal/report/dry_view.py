"""The dry-run summary as terminal lines and as a section of report.html."""

from __future__ import annotations

from html import escape as esc
from typing import Any

from neuronlocal.core.units import fmt_bytes


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _band(b: list[float] | None) -> str:
    return f"{_s(b[0])} - {_s(b[1])}" if b else "-"


def _breakdown(b: dict[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b.items())


def _peak_line(r: dict[str, Any]) -> str:
    if not r.get("peak_op") and not r.get("peak_at"):
        return "peak set at: not known"
    return f"peak set by {r.get('peak_op') or 'an allocation outside an op'} at " \
           f"{r.get('peak_at') or '?'}"


def _cost_lines(s: dict[str, Any]) -> list[str]:
    out = []
    if s.get("step_s") is not None:
        parts = s.get("step_parts_s") or {}
        out.append(f"  step {_s(s['step_s'])} serial (band {_band(s['step_band_s'])}, rank "
                   f"{s.get('step_rank')}): " + ", ".join(
                       f"{k.replace('_', ' ')} {_s(v)}" for k, v in parts.items()))
        if s.get("step_overlapped_s") is not None:
            out.append(f"  step {_s(s['step_overlapped_s'])} with collectives overlapped: "
                       f"{_s(s.get('collectives_alongside_s') or 0.0)} of them run alongside "
                       "compute (FSDP, DDP's buckets, async); tensor parallel and "
                       "synchronous ones on the critical path")
    if s.get("tokens_per_s") is not None:
        usd = s.get("usd_per_million_tokens")
        out.append(f"  {s['tokens_per_step']} tokens per step: {s['tokens_per_s']:,.0f} "
                   f"tokens/s" + (f", ${usd[0]:.3f} per million tokens (band ${usd[1]:.3f}"
                                  f" - ${usd[2]:.3f})" if usd else ""))
    if s.get("mfu") is not None:
        out.append(f"  MFU {100 * s['mfu']:.1f}%")
    lo, hi = s["compile_band_s"]
    out.append(f"  compile bill: {s['graphs']} unique graph(s) across the simulated ranks "
               f"(per rank: {', '.join(map(str, s['graphs_per_rank'])) or '-'}) x "
               f"{s['compile_minutes_per_graph']:.1f} min = {s['compile_s'] / 60:.1f} min "
               f"(band {lo / 60:.0f} - {hi / 60:.0f} min)")
    return out


def assumed_line(a: dict[str, Any]) -> str:
    """"aten::topk indices at moe.py:12: balanced routing over 8 (2 per row) (x4)"."""
    op, _, what = a["op"].partition(": ")
    what = what or "read as zero (the dry run has no value there)"
    return f"{op} at {a['at']}: {what} (x{a['count']})"


def lines(s: dict[str, Any]) -> list[str]:
    """The terminal summary."""
    out = [f"\nneuronlocal dry run: world size {s['world_size']} on {s['nodes']} x "
           f"{s['instance']}, {len(s['ranks'])} rank(s) simulated, {s['steps']} step(s)"]
    for r in s["ranks"]:
        out.append(f"  rank {r['rank']:>4}  peak {fmt_bytes(r['peak_hbm_bytes'])} allocated, "
                   f"{fmt_bytes(r['peak_reserved_bytes'])} reserved of "
                   f"{fmt_bytes(r['hbm_bytes'])}: {r['verdict']}")
        out.append(f"            at the peak: {_breakdown(r['breakdown'])}")
        out.append(f"            {_peak_line(r)}")
        if r["error"]:
            out.append(f"            ended with {r['error']}")
        for a in r["assumed_values"][:10]:
            out.append(f"            assumed: {assumed_line(a)}")
        if len(r["assumed_values"]) > 10:
            out.append(f"            ... {len(r['assumed_values']) - 10} more sites in "
                       "report.json (dry_run.assumptions)")
    if s["collectives"]:
        out.append(f"  collectives (rank {s['collectives_of_rank']}, {s['steps']} step(s)):")
        for c in s["collectives"]:
            out.append(f"    {c['op']:<32} group {c['group_size']:>4}  {c['calls']:>6} calls  "
                       f"{fmt_bytes(c['bytes']):>12}  {c['link']:<10} "
                       f"{_s(c['seconds_per_step'])} per step")
    out += _cost_lines(s)
    out += [f"    recompiled: rank {e['rank']} {e['graph']}: {e['reason']}"
            for e in s["recompiles"][:10]]
    out += [f"  not in this report: {m}" for m in s["missing"]]
    return out


def _table(cols: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(x))}</td>" for x in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html(s: dict[str, Any]) -> str:
    """The dry-run section of report.html."""
    kinds = list(s["ranks"][0]["breakdown"]) if s["ranks"] else []
    parts = [f"<h2>Dry run: world size {s['world_size']} on {s['nodes']} x "
             f"{esc(s['instance'])}</h2>",
             _table(["rank", "peak allocated", "reserved", "of HBM", "verdict", "peak op",
                     "peak line", *kinds],
                    [[r["rank"], fmt_bytes(r["peak_hbm_bytes"]),
                      fmt_bytes(r["peak_reserved_bytes"]), fmt_bytes(r["hbm_bytes"]),
                      r["verdict"], r.get("peak_op") or "", r.get("peak_at") or "",
                      *(fmt_bytes(r["breakdown"][k]) for k in kinds)] for r in s["ranks"]]),
             "<h3>Collectives</h3>",
             _table(["op", "group", "calls", "bytes", "link", "per step"],
                    [[c["op"], c["group_size"], c["calls"], fmt_bytes(c["bytes"]), c["link"],
                      _s(c["seconds_per_step"])] for c in s["collectives"]]),
             "<h3>Time, throughput, cost, compile</h3>",
             "<p>" + "<br>".join(esc(x.strip()) for x in _cost_lines(s)) + "</p>",
             _table(["rank", "recompiled graph", "cause"],
                    [[e["rank"], e["graph"], e["reason"]] for e in s["recompiles"]])
             if s["recompiles"] else "",
             "<h3>What these numbers rest on</h3><ul>"
             + "".join(f"<li>{esc(a)}</li>" for a in s["assumptions"]) + "</ul>"]
    if s["missing"]:
        parts.append("<p>Not in this report: " + esc("; ".join(s["missing"])) + "</p>")
    return "\n".join(parts)
