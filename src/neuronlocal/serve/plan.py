"""The bucket plan for a trace: the fit, the powers-of-two baseline, and their metrics.

A plan is a list of context-encoding buckets (prompt lengths a prefill graph is compiled
for) and a list of token-generation buckets (KV-cache lengths a decode graph is compiled
for), all multiples of STEP (the 128-token tile vLLM-Neuron requires of its decode buckets),
the largest of each forced to the longest prompt and to --max-len, as the baseline's are, so
both serve exactly the same requests. Graphs = the two lists' lengths (one batch size).

Cost minimised (docs/serving.md), in seconds:
    p99 TTFT + (padding prefill seconds + padded-KV decode seconds) / requests
             + graphs x compile seconds / WARMUP_REQUESTS
For every number of buckets the fit takes the exact minimum-padding-cost list of each kind
(`bucketing.fit_buckets` on estimated step times) and, while SIM_BUDGET lasts, simulates the
split of every graph count that the padding cost ranks first, each fitted list next to the
baseline's other list, then the other splits; it keeps the lowest cost among those that
are no worse than the baseline on graphs, padding fraction, p99 TTFT and p99 TPOT, and
serve as many requests in NxD Inference's layout and in `generate`'s static cache (whose
padded prompts a coarser context bucket can push past the top token bucket). The
baseline is itself a candidate, so the plan is never worse on any of them when the baseline
fits in --max-graphs (the default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neuronlocal.compile.bucketing import default_buckets, fit_buckets
from neuronlocal.serve.sim import (
    Curve,
    Sim,
    StepTimes,
    kv_length,
    percentile,
    servable,
    simulate,
)
from neuronlocal.serve.trace import Request

STEP = 128
SIM_BUDGET = 8_000_000  # requests x replicas simulated in all, over every candidate
WARMUP_REQUESTS = 10_000  # requests one warm-up is taken to serve, to price a graph's compile
# Minutes per graph of neuronx-cc. No published benchmark of compile time exists; the band's
# top is a reported 45-minute compile, the bottom the "minutes" TorchNeuron documents for a
# first compile; the middle is their geometric mean, a convention, not a measurement.
COMPILE_MINUTES_BAND = (1.0, 45.0)
COMPILE_MINUTES = math.sqrt(COMPILE_MINUTES_BAND[0] * COMPILE_MINUTES_BAND[1])
COMPILE_SOURCES = (
    "no published neuronx-cc compile time per graph exists; band from user reports: "
    "https://github.com/aws-neuron/aws-neuron-sdk/issues/646 (45 minutes per compile), "
    "https://github.com/aws-neuron/transformers-neuronx/issues/48 (minutes, hours at batch 4)")


def round_up(n: int, step: int = STEP) -> int:
    return max(step, -(-n // step) * step)


def baseline(max_ctx: int, max_len: int) -> tuple[list[int], list[int]]:
    """Powers of two from 128 (NxD Inference's and vLLM-Neuron's default)."""
    return default_buckets(max_ctx, 128), default_buckets(max_len, 128)


@dataclass
class Result:
    ctx: list[int]
    tg: list[int]
    sim: Sim
    requests: int
    compile_minutes: float
    replicas: int = 1
    static_unservable: int = 0  # requests generate's static cache cannot hold (kv_length)

    @property
    def graphs(self) -> int:
        return len(self.ctx) + len(self.tg)

    @property
    def cost(self) -> float:
        s = self.sim
        wasted = (s.padding_s + s.wasted_kv_s) / max(1, self.requests)
        return ((percentile(s.ttft, 99) or 0.0) + wasted
                + self.graphs * self.compile_minutes * 60 / WARMUP_REQUESTS)

    def as_dict(self) -> dict[str, Any]:
        s = self.sim
        lo, hi = COMPILE_MINUTES_BAND
        ms = {k: {q: None if (v := percentile(vals, n)) is None else round(v * 1e3, 3)
                  for q, n in (("p50", 50), ("p99", 99))}
              for k, vals in (("ttft_ms", s.ttft), ("tpot_ms", s.tpot))}
        return {"context_buckets": self.ctx, "token_buckets": self.tg, "graphs": self.graphs,
                "warmup_s": round(self.graphs * self.compile_minutes * 60, 1),
                "warmup_band_s": [self.graphs * lo * 60, self.graphs * hi * 60],
                "padding_fraction": round(s.padding_fraction, 6),
                "kv_waste_fraction": round(s.kv_waste_fraction, 6),
                **ms, "unservable": s.unservable,
                "unservable_static_cache": self.static_unservable,
                "padding_s": round(s.padding_s, 6),
                "wasted_kv_s": round(s.wasted_kv_s, 6), "busy_s": round(s.busy_s, 6),
                "makespan_s": round(s.makespan_s, 6), "cost": round(self.cost, 9)}


def dominates(a: Result, b: Result) -> bool:
    """`a` is no worse than `b` on graphs, padding fraction, p99 TTFT and p99 TPOT, and
    serves as many requests, in NxD Inference's layout and in `generate`'s static cache."""
    eps = 1e-9

    def le(x: float | None, y: float | None) -> bool:
        return x is None or y is None or x <= y * (1 + eps) + eps

    sa, sb = a.sim, b.sim
    return (a.graphs <= b.graphs and le(sa.padding_fraction, sb.padding_fraction)
            and le(percentile(sa.ttft, 99), percentile(sb.ttft, 99))
            and le(percentile(sa.tpot, 99), percentile(sb.tpot, 99))
            and sa.unservable <= sb.unservable and a.static_unservable <= b.static_unservable)


def decode_lengths(requests: Sequence[Request], step: int = STEP) -> dict[int, float]:
    """Decode steps per KV-length cell of `step` tokens: a request of prompt p and output o
    runs steps at cache lengths p+1 .. p+o-1."""
    cells: dict[int, float] = {}
    for r in requests:
        lo, hi = r.prompt + 1, r.prompt + r.output - 1
        while lo <= hi:
            top = min(hi, round_up(lo, step))
            cells[round_up(lo, step)] = cells.get(round_up(lo, step), 0.0) + top - lo + 1
            lo = top + 1
    return cells


def _splits(ok: Sequence[Request], steps: StepTimes, max_ctx: int, max_len: int, limit: int
            ) -> tuple[dict[int, list[int]], dict[int, list[int]],
                       list[tuple[float, int, list[int], list[int]]]]:
    """The exact minimum-padding-cost lists of each kind for every length up to `limit` - 1,
    and every split of them within `limit` graphs, ranked by their padding cost."""
    ctx_lists = {k: fit_buckets([r.prompt for r in ok], k, STEP, steps.prefill, max_ctx)
                 for k in range(1, limit)}
    cells = decode_lengths(ok)
    tg_lists = {k: fit_buckets(cells, k, STEP, steps.decode, max_len) if cells else [max_len]
                for k in range(1, limit)}
    prompt_cells: dict[int, int] = {}
    for r in ok:
        prompt_cells[round_up(r.prompt)] = prompt_cells.get(round_up(r.prompt), 0) + 1

    def proxy(ctx: list[int], tg: list[int]) -> float:
        pre = sum(w * steps.prefill(next(b for b in ctx if b >= c))
                  for c, w in prompt_cells.items())
        dec = sum(w * steps.decode(next(b for b in tg if b >= c)) for c, w in cells.items())
        return pre + dec / steps.batch

    splits = sorted(((proxy(c, t), len(c) + len(t), c, t) for c in ctx_lists.values()
                     for t in tg_lists.values() if len(c) + len(t) <= limit),
                    key=lambda x: (x[0], x[1], x[2], x[3]))
    return ctx_lists, tg_lists, splits


def default_max_len(requests: Sequence[Request]) -> int:
    """--max-len's default, the largest token bucket: the smallest multiple of STEP holding
    every request's static-cache `kv_length` (prompt padded to its baseline context bucket,
    plus output), so the baseline serves the whole trace in every layout the plan prints,
    `generate`'s (and the replay's) included, not only where the KV holds prompt + output."""
    max_ctx = round_up(max(r.prompt for r in requests))
    ctx = default_buckets(max_ctx, 128)
    return round_up(max(kv_length(r, ctx, static_cache=True) for r in requests))


def longest(requests: Sequence[Request], max_len: int) -> tuple[list[Request], int]:
    """The requests that fit `max_len`, and the largest context bucket they need."""
    ok = [r for r in requests if r.prompt + r.output <= max_len]
    if not ok:
        raise ValueError(f"no request fits --max-len {max_len} (prompt + output); raise it")
    return ok, min(max_len, round_up(max(r.prompt for r in ok)))


def per_graph_count(requests: Sequence[Request], steps: StepTimes, max_len: int, limit: int
                    ) -> dict[int, tuple[list[int], list[int]]]:
    """For every graph count up to `limit`, the split the padding cost ranks first."""
    ok, max_ctx = longest(requests, max_len)
    out: dict[int, tuple[list[int], list[int]]] = {}
    for _, g, c, t in _splits(ok, steps, max_ctx, max_len, limit)[2]:
        out.setdefault(g, (c, t))
    return dict(sorted(out.items()))


@dataclass
class Fit:
    plan: Result
    baseline: Result
    dominates: bool
    note: str
    candidates: int


def fit(requests: Sequence[Request], steps: StepTimes, max_len: int, max_graphs: int | None,
        compile_minutes: float = COMPILE_MINUTES, replicas: int = 1) -> Fit:
    """The plan for `requests` served by `replicas` replicas, with buckets up to `max_len` (a
    multiple of STEP) and at most `max_graphs` graphs (None: as many as the baseline has)."""
    ok, max_ctx = longest(requests, max_len)
    base_ctx, base_tg = baseline(max_ctx, max_len)
    n = len(requests)

    def run(ctx: list[int], tg: list[int]) -> Result:
        static = sum(not servable(r, ctx, tg, static_cache=True) for r in requests)
        return Result(ctx, tg, simulate(requests, ctx, tg, steps, replicas), n,
                      compile_minutes, replicas, static)

    base = run(base_ctx, base_tg)
    limit = base.graphs if max_graphs is None else max_graphs
    if limit < 2:
        raise ValueError("--max-graphs must be at least 2 (one prefill and one decode graph)")
    ctx_lists, tg_lists, splits = _splits(ok, steps, max_ctx, max_len, limit)
    per_count: dict[int, tuple[list[int], list[int]]] = {}
    for _, g, c, t in splits:
        per_count.setdefault(g, (c, t))
    anchored = [(c, base_tg) for c in ctx_lists.values() if len(c) + len(base_tg) <= limit]
    anchored += [(base_ctx, t) for t in tg_lists.values() if len(base_ctx) + len(t) <= limit]
    order = [*per_count.values(), *anchored, *((c, t) for _, _, c, t in splits)]
    seen = {(tuple(base_ctx), tuple(base_tg))}
    results = [base]
    for c, t in order:
        if (tuple(c), tuple(t)) in seen:
            continue
        if len(results) >= 2 and len(results) * n * replicas > SIM_BUDGET:
            break
        seen.add((tuple(c), tuple(t)))
        results.append(run(list(c), list(t)))
    if base.graphs > limit:
        results.remove(base)
    better = [r for r in results if dominates(r, base)]
    pool = better or results
    plan = min(pool, key=lambda r: (r.cost, r.graphs, r.ctx, r.tg))
    note = ""
    if not better:
        note = (f"the baseline needs {base.graphs} graphs, over --max-graphs {limit}; no plan "
                "within the limit is as good as it on every metric")
    return Fit(plan, base, dominates(plan, base), note, len(results))


def step_times(cfg: Any, instance: str, tp: int, batch: int, max_len: int,
               lnc: int | None = None, counts: dict[tuple[str, int, int, int], Any] | None = None
               ) -> tuple[StepTimes, dict[str, float], int]:
    """Estimated prefill (batch 1) and decode (batch `batch`) step seconds at lengths 16 and
    the powers of two from 128 to `max_len`, from `neuronlocal estimate`'s model; with the
    HBM per core (weights, KV cache at `max_len`) and the HBM a core has. `counts` keeps the
    model's counted work between calls (it depends on the shapes, not on TP)."""
    from neuronlocal.estimate import FACTORS
    from neuronlocal.estimate.layout import Layout, Plan, memory
    from neuronlocal.estimate.rates import instance as spec_of
    from neuronlocal.estimate.workload import count

    cache = {} if counts is None else counts
    cores = spec_of(instance, lnc).cores

    def step(lay: Layout) -> tuple[float, dict[str, float], int]:
        key = (lay.mode, lay.micro_batch, 1 if lay.mode == "decode" else lay.seq, lay.ctx)
        if key not in cache:
            cache[key] = count(cfg, *key)
        work = cache[key]
        return Plan(lay, work).breakdown(FACTORS).step, memory(lay, work), lay.spec.hbm_bytes

    grid = sorted({16, *default_buckets(max_len, 128)})
    pre: dict[int, float] = {}
    dec: dict[int, float] = {}
    hbm: dict[str, float] = {}
    per_core = 0
    for x in grid:
        pre[x] = step(Layout(instance, "prefill", tp=tp, dp=cores // tp, seq=x, lnc=lnc))[0]
        dec[x], hbm, per_core = step(Layout(instance, "decode", tp=tp, dp=cores // tp,
                                            micro_batch=batch, ctx=x, lnc=lnc))
    return StepTimes(Curve(pre), Curve(dec), batch), hbm, per_core
