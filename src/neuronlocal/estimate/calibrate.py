"""Fits the roofline's efficiency factors to published benchmarks and measures the error.

`python -m neuronlocal.estimate.calibrate` counts every published row's workload on the
meta device, fits the factors on the rows not held out (Nelder-Mead on the mean squared
log error, each metric weighted equally, from a fixed start: deterministic), then reports
the error of every row. `--write` stores the result in fitted.py and the tables in
docs/estimate.md. Held-out rows never influence the fit.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from neuronlocal.estimate import MODE_METRIC
from neuronlocal.estimate.layout import Layout, Plan
from neuronlocal.estimate.published import ROWS, Row, held_out
from neuronlocal.estimate.roofline import NAMES, Factors
from neuronlocal.estimate.workload import Workload, count, load_config

# Bounds of each factor (log-space search keeps them positive and inside these).
BOUNDS = {"tensor": (0.05, 1.0), "hbm": (0.05, 1.0), "vector": (0.02, 1.0),
          "fusion": (0.01, 1.0), "link": (0.02, 1.0), "latency": (1e-6, 2e-3),
          "launch": (1e-6, 0.05), "train": (1.0, 4.0)}
START = Factors(tensor=0.5, hbm=0.6, vector=0.5, fusion=0.3, link=0.5, latency=50e-6,
                launch=1e-3, train=1.3)
BAND_QUANTILE = 0.8  # the band covers this share of held-out rows
ROBUST = 0.3  # Cauchy loss scale (log error): a row off by far more pulls the fit little


def workload_for(row: Row, cache: dict[tuple, Workload] | None = None) -> Workload:
    dtype = torch.float32 if row.dtype == "fp32" else torch.bfloat16
    key = (row.model, row.arch, row.mode, row.micro_batch, row.seq, row.ctx, row.dtype)
    if cache is not None and key in cache:
        return cache[key]
    work = count(load_config(row.model), row.mode, row.micro_batch, row.seq, row.ctx,
                 row.arch, dtype)
    if cache is not None:
        cache[key] = work
    return work


def layout_for(row: Row) -> Layout:
    return Layout(row.instance, row.mode, row.nodes, row.tp, row.pp, row.dp, row.micro_batch,
                  row.global_batch, max(row.seq, 1), row.ctx, 1, row.dtype)


def predictor(row: Row, work: Workload) -> Callable[[Factors], float]:
    """The row's metric as a function of the factors."""
    plan = Plan(layout_for(row), work)
    cores = plan.layout.spec.cores

    def predict(f: Factors) -> float:
        step = plan.breakdown(f).step
        if row.metric == "seq_per_s":
            return plan.layout.batch / step
        if row.metric == "items_per_s":
            return cores * row.micro_batch / step
        return step * 1000.0  # ttft_ms, tpot_ms

    return predict


def _factors(x: np.ndarray) -> Factors:
    vals = {}
    for name, v in zip(NAMES, x, strict=True):
        lo, hi = BOUNDS[name]
        vals[name] = float(min(max(math.exp(v), lo), hi))
    return Factors(**vals)


def _nelder_mead(fn: Callable[[np.ndarray], float], x0: np.ndarray, iters: int = 3000,
                 step: float = 0.5) -> np.ndarray:
    """Plain Nelder-Mead with a fixed start simplex: the same inputs give the same result."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [fn(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-12:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        refl = centroid + (centroid - worst)
        fr = fn(refl)
        if fr < values[0]:
            exp = centroid + 2 * (centroid - worst)
            fe = fn(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = centroid + 0.5 * (worst - centroid)
            fc = fn(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [fn(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


@dataclass
class Result:
    factors: Factors
    rows: list[tuple[Row, float, bool]]  # (row, predicted, held out)

    def errors(self, held: bool | None = None, prefix: str = "", excluded: bool = False
               ) -> list[float]:
        """Absolute relative errors |pred/measured - 1| of the chosen rows (used rows, or
        with excluded=True the excluded ones)."""
        return [abs(p / r.value - 1) for r, p, h in self.rows
                if (held is None or h == held) and r.instance.startswith(prefix)
                and bool(r.excluded) == excluded]

    def band(self, metric: str | None = None) -> float:
        """Relative half-width covering BAND_QUANTILE of the held-out rows (of `metric`, and
        never narrower than over all of them), in log terms: x/÷(1 + band)."""
        logs = sorted(abs(math.log(p / r.value)) for r, p, h in self.rows
                      if h and (metric is None or r.metric == metric))
        if not logs:
            return float("nan")
        own = math.exp(float(np.quantile(logs, BAND_QUANTILE))) - 1
        return own if metric is None else max(own, self.band())


def fit(rows: tuple[Row, ...] = ROWS, progress: bool = False) -> Result:
    held = held_out(rows)
    cache: dict[tuple, Workload] = {}
    items = rows
    if progress:
        from tqdm import tqdm

        items = tqdm(rows, desc="counting published workloads on meta", unit="row")
    preds = [predictor(r, workload_for(r, cache)) for r in items]
    fit_idx = [i for i, r in enumerate(rows) if r.id not in held and not r.excluded]
    metrics = sorted({rows[i].metric for i in fit_idx})
    weight = {m: 1.0 / sum(1 for i in fit_idx if rows[i].metric == m) for m in metrics}

    def loss(x: np.ndarray) -> float:
        f = _factors(x)
        total = 0.0
        for i in fit_idx:
            p = preds[i](f)
            err = math.log(p / rows[i].value) / ROBUST
            total += weight[rows[i].metric] * math.log1p(err * err)
        # keep the search inside the bounds (the clamp in _factors is flat outside them)
        for name, v in zip(NAMES, x, strict=True):
            lo, hi = BOUNDS[name]
            total += 10 * (max(0.0, math.log(lo) - v) + max(0.0, v - math.log(hi))) ** 2
        return total

    x = np.log(START.vector_())
    for _ in range(3):  # restarts from the best point escape early collapse
        x = _nelder_mead(loss, x)
    f = _factors(x)
    return Result(f, [(r, preds[i](f), r.id in held) for i, r in enumerate(rows)])


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def _sources(res: Result) -> dict[str, str]:
    keys: dict[str, str] = {}
    for r, _, _ in res.rows:
        keys.setdefault(r.source, f"S{len(keys) + 1}")
    return keys


def _setup(r: Row) -> str:
    if r.mode == "train":
        par = f"{r.nodes} node(s), TP={r.tp}" + (f" PP={r.pp}" if r.pp > 1 else "") + \
            f" DP={r.dp}, micro-batch {r.micro_batch}, global {r.global_batch}, seq {r.seq}"
        return par + (", FP32" if r.dtype == "fp32" else "")
    if r.mode == "forward":
        return f"batch {r.micro_batch} per core, seq {r.seq}"
    if r.mode == "prefill":
        return f"TP={r.tp}, prompt {r.seq}"
    return f"TP={r.tp}, batch {r.micro_batch}, context {r.ctx}"


def table(res: Result) -> str:
    """Markdown: every row, its setup, measured and estimated value, error, set, source."""
    src = _sources(res)
    out = ["| set | row | instance | setup | metric | measured | estimated | error | SDK | src |",
           "|---|---|---|---|---|---:|---:|---:|---|---|"]
    for r, p, h in res.rows:
        label = "excluded" if r.excluded else ("**held-out**" if h else "fit")
        out.append(f"| {label} | `{r.id}` | {r.instance} | {_setup(r)} | {r.metric} | "
                   f"{r.value:g} | {p:.4g} | {_pct(p / r.value - 1)} | {r.sdk} | {src[r.source]} |")
    out.append("")
    out += [f"- {k}: {url}" for url, k in src.items()]
    return "\n".join(out)


def docs_block(res: Result) -> str:
    """The generated part of docs/estimate.md (factors, error summary, every row)."""
    f = res.factors
    factors = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in f.as_dict().items())
    bands = "\n".join(
        ["| estimate | band (80% of held-out rows of its kind, never below all rows') |",
         "|---|---|", f"| any (compiled graphs) | x/÷{1 + res.band():.3f} |"]
        + [f"| {mode} ({m}) | x/÷{1 + res.band(m):.3f} |" for mode, m in MODE_METRIC.items()])
    return (f"{BEGIN}\n\n### Fitted factors\n\n| factor | value |\n|---|---:|\n{factors}\n\n"
            f"### Errors\n\n{summary(res)}\n\n### Bands\n\n{bands}\n\n"
            f"### Every row\n\n{table(res)}\n\n{END}")


BEGIN = "<!-- generated by python -m neuronlocal.estimate.calibrate --write: begin -->"
END = "<!-- generated: end -->"


def summary(res: Result) -> str:
    lines = ["| rows | n | median abs error | 80th percentile |", "|---|---:|---:|---:|"]
    for label, held, prefix in (("fit", False, ""), ("held-out", True, ""),
                                ("held-out, trn2 only", True, "trn2"),
                                ("all trn2 rows", None, "trn2")):
        e = res.errors(held, prefix)
        if e:
            lines.append(f"| {label} | {len(e)} | {100 * float(np.median(e)):.1f}% | "
                         f"{100 * float(np.quantile(e, 0.8)):.1f}% |")
    for metric in sorted({r.metric for r, _, h in res.rows if h}):
        e = [abs(p / r.value - 1) for r, p, h in res.rows if h and r.metric == metric]
        lines.append(f"| held-out {metric} | {len(e)} | {100 * float(np.median(e)):.1f}% | "
                     f"{100 * float(np.quantile(e, 0.8)):.1f}% |")
    for label, excl in (("excluded (not fitted, not held out)", True),):
        e = res.errors(None, "", excl)
        if e:
            lines.append(f"| {label} | {len(e)} | {100 * float(np.median(e)):.1f}% | "
                         f"{100 * float(np.quantile(e, 0.8)):.1f}% |")
    return "\n".join(lines)


def write_fitted(res: Result, path: Path) -> None:
    held = res.errors(True)
    factors = "".join(f"    {k}={v!r},\n" for k, v in res.factors.as_dict().items())
    path.write_text(
        '"""Factors fitted by `python -m neuronlocal.estimate.calibrate --write` (generated)."""\n'
        "\nfrom neuronlocal.estimate.roofline import Factors\n\n"
        f"FACTORS = Factors(\n{factors})\n"
        f"HELD_OUT_MEDIAN_ERROR = {float(np.median(held))!r}\n"
        f"BAND = {res.band()!r}  # relative half-width covering 80% of held-out rows\n"
        "# per estimate kind (the metric its held-out rows measure), never below BAND\n"
        "BANDS = {\n" + "".join(f"    {m!r}: {res.band(m)!r},\n" for m in MODE_METRIC.values())
        + "}\n"
        f"HELD_OUT_ROWS = {len(held)}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m neuronlocal.estimate.calibrate")
    ap.add_argument("--write", action="store_true",
                    help="update fitted.py and the generated tables in --docs")
    ap.add_argument("--docs", default="docs/estimate.md", help="default docs/estimate.md")
    args = ap.parse_args(argv)
    res = fit(progress=True)
    print(res.factors)
    print(summary(res))
    print(table(res))
    if args.write:
        write_fitted(res, Path(__file__).with_name("fitted.py"))
        doc = Path(args.docs)
        text = doc.read_text()
        start, end = text.index(BEGIN), text.index(END) + len(END)
        doc.write_text(text[:start] + docs_block(res) + text[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
