"""The estimate's part of the run report and of `neuronlocal check`, as rows and lines.

The report renderer owns tables and charts; this module only turns each rank's
`estimate` snapshot (capture.py) into titled rows, one-line summaries and chart bars, so
the renderer needs a few lines to show them. Every estimate is printed with its band.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neuronlocal.core.charts import COLORS
from neuronlocal.estimate.graphs import CALIBRATED_MIN_S

BELOW = "below the calibrated range (< 5 ms)"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def _band(lo_hi: list[float]) -> str:
    return f"{_ms(lo_hi[0])}-{_ms(lo_hi[1])}"


def _ranks(rep: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
    multi = len(rep["ranks"]) > 1
    return [([str(r["rank"])] if multi else [], r.get("estimate") or {}) for r in rep["ranks"]]


def tables(rep: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) of the per-graph and per-step tables."""
    ranks = _ranks(rep)
    if not any(e for _, e in ranks):
        return []
    rank_col = ["rank"] if len(rep["ranks"]) > 1 else []
    first = next(e for _, e in ranks if e)
    where = f"one logical core of {first['instance']} (LNC={first['lnc']})"
    graphs = [rk + [g["graph"], str(g["calls"]), _ms(g["host_s_per_call"]),
                    _ms(g["estimated_s_per_call"]),
                    _band([g["estimated_s_per_call"] / (1 + e["band"]),
                           g["estimated_s_per_call"] * (1 + e["band"])]),
                    f"not estimated: {g['not_estimated']}"[:120] if g.get("not_estimated")
                    else "" if g["calibrated"] else BELOW]
              for rk, e in ranks for g in e.get("graphs", [])]
    steps = [rk + [str(s["step"]), _ms(_run_s(s)), f"{s.get('compile_s', 0.0):.2f}",
                   _ms(s["estimated_s"]), _band(s["band_s"]),
                   _ms(s["compiled_s"]) if "compiled_s" in s else "-",
                   _band(s["compiled_band_s"]) if "compiled_band_s" in s else "-",
                   str(s["eager_ops"]), str(s.get("eager_launches", "-")),
                   str(s["graph_calls"]),
                   "" if s.get("compiled_s", s["estimated_s"]) >= CALIBRATED_MIN_S else BELOW]
             for rk, e in ranks for s in e.get("steps", [])]
    out = []
    if graphs:
        out.append((f"Compiled graphs: estimated Trainium time per call, {where}",
                    rank_col + ["graph", "calls", "host ms", "Trainium ms", "band ms", "note"],
                    graphs))
    if steps:
        out.append((f"Training steps (optimizer steps): estimated Trainium time, {where}",
                    rank_col + ["step", "host ms", "compile s", "Trainium ms", "band ms",
                                "compiled ms", "band ms", "eager ops", "launches",
                                "graph calls", "note"], steps))
    return out


def headlines(rep: dict[str, Any]) -> list[str]:
    """One line per rank: the estimated step time and cost on the emulated instance."""
    out = []
    multi = len(rep["ranks"]) > 1
    for r in rep["ranks"]:
        e = r.get("estimate") or {}
        s = e.get("summary")
        if not s:
            continue
        p = f"rank {r['rank']}: " if multi else ""
        eager = bool(s.get("eager_launches"))
        line = (f"{p}estimated Trainium step on {e['instance']} (LNC={e['lnc']})"
                + (", eager as run" if eager else "") + f": {_ms(s['estimated_step_s'])} ms "
                f"(band {_band(s['band_s'])} ms, "
                + ("launch cost assumed" if eager else f"x/÷{1 + e['step_band']:.2f}")
                + f") vs {_ms(s['host_step_s'])} ms on this host (compiling excluded), "
                f"median of {_steps_used(s)}"
                + ("" if eager or s["estimated_step_s"] >= CALIBRATED_MIN_S
                   else f" ({BELOW}: band not validated)"))
        if s.get("usd_per_hour") is not None:
            cost = s["usd_per_1000_steps"]
            line += (f"; ${cost[0]:.4g} per 1000 steps (band ${cost[1]:.3g}-${cost[2]:.3g}) at "
                     f"${s['usd_per_hour']:.2f}/h" + ("" if s["price_verified"] else
                                                      " (unverified price)"))
        out.append(line)
        if eager:
            out.append(f"{p}  {_eager_line(s, e['step_band'])}")
    return out


def _eager_line(s: dict[str, Any], width: float) -> str:
    """Eager vs compiled: what TorchNeuron's per-op launches cost and compiling saves."""
    per, low, high = s["launch_s"]
    fused = s["compiled_step_s"]
    gain = s["estimated_step_s"] / fused if fused > 0 else 0.0
    return (f"compiled (torch.compile: fused, one graph launch): {_ms(fused)} ms (band "
            f"{_band(s['compiled_band_s'])} ms, x/÷{1 + width:.2f}"
            + ("" if fused >= CALIBRATED_MIN_S else f"; {BELOW}") + f"), {gain:.1f}x faster; "
            f"eager pays {s['eager_launches']} kernel launches per step at an assumed "
            f"{per * 1e6:.0f} us each (range {low * 1e6:.0f} us - {high * 1e3:.2f} ms; no "
            "published per-launch figure exists)")


def _steps_used(summary: dict[str, Any]) -> str:
    """Which steps a median rests on: all of them, or the window kept of a long run."""
    n, gone = summary["steps"], summary.get("steps_summarised", 0)
    if not gone:
        return f"{n} steps"
    return (f"the {summary['steps_kept']} steps kept of {n} (the first and the last; "
            f"{gone} steps in between are summarised as totals only)")


def _run_s(step: dict[str, Any]) -> float:
    """Host seconds of a step spent running, not compiling."""
    return float(step["host_s"]) - float(step.get("compile_s", 0.0))


def bars(rep: dict[str, Any], limit: int = 30) -> list[tuple[str, float, str]]:
    """(label, milliseconds, color) bars: host (compiling excluded) vs estimated Trainium
    time per step."""
    out = []
    multi = len(rep["ranks"]) > 1
    for r in rep["ranks"]:
        for s in (r.get("estimate") or {}).get("steps", [])[:limit]:
            p = f"r{r['rank']} " if multi else ""
            out.append((f"{p}step {s['step']} host", _run_s(s) * 1e3, COLORS["grey"]))
            out.append((f"{p}step {s['step']} Trainium", s["estimated_s"] * 1e3, COLORS["orange"]))
    return out


def compile_bars(rep: dict[str, Any], limit: int = 30) -> list[tuple[str, float, str]]:
    """(label, seconds, color) bars: compile seconds inside each step that compiled."""
    multi = len(rep["ranks"]) > 1
    return [((f"r{r['rank']} " if multi else "") + f"step {s['step']} compile",
             float(s["compile_s"]), COLORS["blue"])
            for r in rep["ranks"] for s in (r.get("estimate") or {}).get("steps", [])[:limit]
            if s.get("compile_s", 0.0) > 0.0]


def html(rep: dict[str, Any], table: Callable[..., str], bar_chart: Callable[..., str],
         escape: Callable[[Any], str]) -> str:
    """The report's HTML section, drawn with the renderer's own table and chart helpers."""
    parts = ["<h2>Estimated Trainium time and cost</h2><p>From a roofline calibrated on "
             "published Neuron benchmarks (docs/estimate.md); each estimate comes with the "
             "band that 80% of held-out published rows fell in. Eager steps pay one kernel "
             "launch per op, as TorchNeuron runs them; that per-launch cost is an assumption "
             "(no published figure), and its range is part of the band.</p>"]
    parts += [f"<p>{escape(line)}</p>" for line in headlines(rep)]
    # Compile seconds get their own chart (own scale): one 120 s compile step on the same
    # linear axis would flatten every millisecond step; a log axis would hide the host vs
    # Trainium ratio the chart is read for.
    charts = (bar_chart(bars(rep), "host (compiling excluded) vs estimated Trainium "
                        "milliseconds per step", unit="ms")
              + bar_chart(compile_bars(rep), "seconds compiling graphs, per step that compiled",
                          unit="s"))
    if charts:
        parts.append(f"<div class='charts'>{charts}</div>")
    for title, cols, rows in tables(rep):
        parts.append(f"<h3>{escape(title)}</h3>")
        parts.append(table(cols, rows))
    if len(parts) == 1:
        parts.append("<p class='none'>no compiled graphs or training steps captured</p>")
    return "".join(parts)


def text(snapshot: dict[str, Any]) -> str:
    """Plain-text tables of one process's snapshot (for `neuronlocal check`)."""
    rep = {"ranks": [{"rank": 0, "estimate": snapshot}]}
    lines = []
    for title, cols, rows in tables(rep):
        lines.append(title)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True))
                  for r in rows[:20]]
    return "\n".join(lines + headlines(rep))
