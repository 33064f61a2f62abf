"""`serve-plan --slo-*`: the cheapest rental that meets latency targets on the trace.

The search space is instance count (1 to --max-instances) x TP (every divisor of the
instance's logical cores the model's heads allow) x batch (powers of two from 1 to 64 whose
weights and KV cache at --max-len fit a core's HBM) x buckets (the powers-of-two baseline and,
for every graph count within --max-graphs, the fitted split the padding cost ranks first).
Each instance holds cores / TP replicas, all used: the price is per instance, so more replicas
never cost more. Instance counts are tried in increasing order; the first at which some
configuration meets every target is the cheapest; among those the lowest cost per output
token (the same for all when they keep up with the arrivals; for an offline batch, the
highest capacity), then the fewest graphs (the shortest warm-up), then the lowest p99 TTFT.
The cheapest powers-of-two configuration is searched the same way with the baseline buckets
only.

Pruned without simulating: a (TP, batch) whose replicas cannot keep up with the arrival rate
(simulated capacity), or whose unqueued latency already misses a target (each prompt's
prefill at its length rounded up to 128, each decode step at the request's own length: no
bucket or queue is faster); a (TP, batch) that misses at under MIN_UTILISATION utilisation is
not tried with more instances (it has next to no queue left to shorten). The fitted buckets
are tried finest first: when the split with the most graphs misses, the coarser ones are not
simulated; when it meets, the fewest graphs that still meet are found by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from neuronlocal.serve.capacity import Capacity, arrival_rate, capacity, cost
from neuronlocal.serve.plan import (
    baseline,
    longest,
    per_graph_count,
    round_up,
    step_times,
)
from neuronlocal.serve.sim import Sim, StepTimes, percentile, simulate
from neuronlocal.serve.trace import Request

TARGETS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
MIN_UTILISATION = 0.25


def value(sim_or_lists: Sim | tuple[list[float], list[float]], name: str) -> float | None:
    """A target's measure (seconds) on a simulation: 'ttft_p99' is the 99th percentile TTFT."""
    ttft, tpot = ((sim_or_lists.ttft, sim_or_lists.tpot) if isinstance(sim_or_lists, Sim)
                  else sim_or_lists)
    kind, q = name.split("_")
    return percentile(ttft if kind == "ttft" else tpot, int(q[1:]))


def ratios(measured: Sim | tuple[list[float], list[float]], targets: dict[str, float]
           ) -> dict[str, float]:
    """Measure / target for every target (at most 1 when met; no TPOT counts as met)."""
    return {k: (v / t if t > 0 else math.inf) if (v := value(measured, k)) is not None else 0.0
            for k, t in targets.items()}


@dataclass
class _Pair:
    tp: int
    batch: int
    steps: StepTimes
    hbm: float
    per_core: int
    cap: Capacity
    replicas_each: int
    splits: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    live: bool = True


@dataclass
class _Tried:
    pair: _Pair
    instances: int
    ctx: list[int]
    tg: list[int]
    sim: Sim
    ratios: dict[str, float]

    @property
    def graphs(self) -> int:
        return len(self.ctx) + len(self.tg)

    @property
    def meets(self) -> bool:
        return all(r <= 1.0 for r in self.ratios.values())


def _pairs(requests: Sequence[Request], cfg: Any, instance: str, lnc: int | None,
           max_len: int, targets: dict[str, float], pruned: list[tuple[float, str]]
           ) -> list[_Pair]:
    from neuronlocal.estimate.layout import Layout, problems
    from neuronlocal.estimate.rates import instance as spec_of
    from neuronlocal.estimate.workload import shape

    cores = spec_of(instance, lnc).cores
    ok, max_ctx = longest(requests, max_len)
    base_ctx, base_tg = baseline(max_ctx, max_len)
    sh = shape(cfg, 0)
    counts: dict[tuple[str, int, int, int], Any] = {}
    out = []
    for tp in (d for d in range(1, cores + 1) if cores % d == 0):
        if problems(Layout(instance, "decode", tp=tp, dp=cores // tp, lnc=lnc), sh):
            continue
        for batch in BATCHES:
            steps, hbm, per_core = step_times(cfg, instance, tp, batch, max_len, lnc, counts)
            if sum(hbm.values()) > per_core:
                break  # larger batches hold more KV cache still
            floor = ([steps.prefill(round_up(r.prompt)) for r in ok],
                     [steps.decode(r.prompt + 1) for r in ok if r.output > 1])
            over = {k: v for k, v in ratios(floor, targets).items() if v > 1}
            if over:
                k = max(over, key=lambda x: over[x])
                pruned.append((over[k], f"{k.replace('_', ' ').upper()} fails first: even "
                               f"without queueing or padding it is {over[k]:.2f}x the "
                               f"target at TP={tp} batch {batch}"))
                continue
            cap = capacity(ok, base_ctx, base_tg, steps)
            out.append(_Pair(tp, batch, steps, sum(hbm.values()), per_core, cap, cores // tp))
    return out


def _fitted(p: _Pair, n: int, run: Any, max_len: int, max_graphs: int,
            requests: Sequence[Request]) -> list[_Tried]:
    """The fitted split with the fewest graphs that meets the targets on `n` instances (tried
    finest first, then bisected), or nothing."""
    if not p.splits:
        p.splits = per_graph_count(requests, p.steps, max_len, max_graphs)
    counts = sorted(p.splits)
    top = run(p, n, *p.splits[counts[-1]])
    if not top.meets:
        return []
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        t = run(p, n, *p.splits[counts[mid]])
        lo, hi, top = (lo, mid, t) if t.meets else (mid + 1, hi, top)
    return [top]


def search(requests: Sequence[Request], cfg: Any, instance: str, lnc: int | None,
           max_len: int, max_graphs: int, targets: dict[str, float], max_instances: int,
           usd: float | None, price_note: str, compile_minutes: float) -> dict[str, Any]:
    """The SLO answer as plain data (see the module docstring for the search)."""
    rate = arrival_rate(requests)
    base = baseline(longest(requests, max_len)[1], max_len)
    pruned: list[tuple[float, str]] = []
    pairs = _pairs(requests, cfg, instance, lnc, max_len, targets, pruned)
    tried: list[_Tried] = []

    def run(p: _Pair, n: int, ctx: list[int], tg: list[int]) -> _Tried:
        s = simulate(requests, ctx, tg, p.steps, n * p.replicas_each)
        t = _Tried(p, n, ctx, tg, s, ratios(s, targets))
        tried.append(t)
        return t

    trace_out = None if rate is None else sum(r.output for r in requests) / (
        max(r.arrival for r in requests) - min(r.arrival for r in requests))

    def _rank(t: _Tried) -> tuple[float, int, float]:
        """Cheapest per output token first (the rental serves the trace's rate, or its
        capacity for an offline batch), then the fewest graphs, then the lowest p99 TTFT."""
        served = t.instances * t.pair.replicas_each * t.pair.cap.output_tps
        served = served if trace_out is None else min(served, trace_out)
        return -round(served, 6), t.graphs, t.ratios.get("ttft_p99", 0.0)

    best: _Tried | None = None
    pow2: _Tried | None = None
    for n in range(1, max_instances + 1):
        found: list[_Tried] = []
        found_pow2: list[_Tried] = []
        for p in pairs:
            if not p.live or (rate is not None and n * p.replicas_each * p.cap.rps <= rate):
                continue
            b = run(p, n, *base)
            if b.meets:
                found_pow2.append(b)
            if best is None:
                found += _fitted(p, n, run, max_len, max_graphs, requests)
                if b.meets and b.graphs <= max_graphs:
                    found.append(b)
            util = None if rate is None else rate / (n * p.replicas_each * p.cap.rps)
            if not b.meets and util is not None and util < MIN_UTILISATION:
                p.live = False
        if found and best is None:
            best = min(found, key=_rank)
        if found_pow2 and pow2 is None:
            pow2 = min(found_pow2, key=_rank)
        if best is not None and pow2 is not None:
            break
    out: dict[str, Any] = {
        "targets_s": targets, "max_instances": max_instances, "max_graphs": max_graphs,
        "simulations": len(tried), "pruned": [why for _, why in pruned], "met": best is not None,
        "best": None if best is None else _describe(best, requests, usd, price_note,
                                                    compile_minutes),
        "powers_of_two": None if pow2 is None else _describe(pow2, requests, usd, price_note,
                                                             compile_minutes),
    }
    if best is None:
        out["failure"] = _failure(tried, pruned, targets, max_instances, pairs, rate)
    return out


def _describe(t: _Tried, requests: Sequence[Request], usd: float | None, price_note: str,
              compile_minutes: float) -> dict[str, Any]:
    p = t.pair
    replicas = t.instances * p.replicas_each
    cap = capacity(requests, t.ctx, t.tg, p.steps)
    c = cost(requests, cap, replicas, t.instances, usd, price_note)
    rate = arrival_rate(requests)
    ms = {k: None if (v := value(t.sim, k)) is None else round(v * 1e3, 3) for k in TARGETS}
    return {"tp": p.tp, "batch": p.batch, "instances": t.instances, "replicas": replicas,
            "replicas_per_instance": p.replicas_each, "context_buckets": t.ctx,
            "token_buckets": t.tg, "graphs": t.graphs,
            "warmup_s": round(t.graphs * compile_minutes * 60, 1),
            "hbm_per_core_bytes": p.hbm, "hbm_core_bytes": p.per_core,
            "latency_ms": ms, "capacity_rps": round(cap.rps, 6),
            "arrival_rps": None if rate is None else round(rate, 6),
            "utilisation": None if rate is None or cap.rps <= 0 else
            round(rate / (replicas * cap.rps), 4),
            "saturated": rate is not None and rate >= replicas * cap.rps,
            "cost_per_hour": c.per_hour,
            "cost_per_million_tokens": None if c.per_million_output is None
            else round(c.per_million_output, 6)}


def _failure(tried: list[_Tried], pruned: list[tuple[float, str]],
             targets: dict[str, float], max_instances: int, pairs: list[_Pair],
             rate: float | None) -> str:
    """Which target fails first and by how much, at the configuration closest to meeting."""
    if not tried and pairs and rate is not None:
        top = max(pairs, key=lambda p: p.replicas_each * p.cap.rps)
        each = top.replicas_each * top.cap.rps
        return (f"capacity fails first: requests arrive at {rate:.3g}/s and {max_instances} "
                f"instance(s) serve at most {max_instances * each:.3g}/s (TP={top.tp} batch "
                f"{top.batch}, simulated); {math.floor(rate / each) + 1} instances would keep "
                "up (--max-instances)")
    if not tried:
        if not pruned:
            return "no TP and batch fits the model's weights and KV cache in a core's HBM"
        return min(pruned)[1] + " (the closest configuration; no number of replicas helps)"
    close = min(tried, key=lambda t: (max(t.ratios.values()), t.instances))
    k = max(close.ratios, key=lambda x: close.ratios[x])
    v = value(close.sim, k) or 0.0
    return (f"{k.replace('_', ' ').upper()} fails first: {v:.3g} s against the target "
            f"{targets[k]:.3g} s ({close.ratios[k]:.2f}x) at the closest configuration, TP="
            f"{close.pair.tp} batch {close.pair.batch} on {close.instances} instance(s) "
            f"(searched up to --max-instances {max_instances})")


def render(slo: dict[str, Any], instance: str) -> list[str]:
    """The SLO answer as lines of text."""
    goal = ", ".join(f"{k.replace('_', ' ').upper()} <= {v:g} s"
                     for k, v in slo["targets_s"].items())
    lines = [f"SLO search ({goal}; {slo['simulations']} configurations simulated, "
             f"within --max-graphs {slo['max_graphs']}, up to {slo['max_instances']} "
             f"instances):"]
    if not slo["met"]:
        lines.append(f"  not met: {slo['failure']}")
    for label, key in (("cheapest", "best"), ("cheapest powers of two", "powers_of_two")):
        d = slo[key]
        if d is None:
            if slo["met"]:
                lines.append(f"  {label}: none meets the targets within the search space")
            continue
        lat = d["latency_ms"]
        usd = "unknown" if d["cost_per_hour"] is None else f"${d['cost_per_hour']:,.2f}"
        per_m = ("unknown" if d["cost_per_million_tokens"] is None
                 else f"${d['cost_per_million_tokens']:.3f}")
        util = "" if d["utilisation"] is None else f", utilisation {d['utilisation']:.0%}"
        lines += [
            f"  {label}: {d['instances']} x {instance}, {d['replicas']} replicas of TP="
            f"{d['tp']} at batch {d['batch']}: {usd}/hour, {per_m} per million output tokens"
            f" (price table; simulated throughput)",
            f"    buckets {d['context_buckets']} / {d['token_buckets']}: {d['graphs']} graphs, "
            f"warm-up {d['warmup_s'] / 60:.0f} min (assumed minutes per graph); HBM per core "
            f"{d['hbm_per_core_bytes'] / 2**30:.2f} of {d['hbm_core_bytes'] / 2**30:.0f} GiB "
            "(estimated)",
            f"    simulated TTFT p50 / p99 {lat['ttft_p50']} / {lat['ttft_p99']} ms, TPOT "
            f"{lat['tpot_p50']} / {lat['tpot_p99']} ms{util}",
        ]
    return lines
