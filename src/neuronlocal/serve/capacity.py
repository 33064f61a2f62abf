"""Saturation and price: what one replica sustains on a trace's mix, how fast the trace's
requests arrive, how many replicas keep up, and what the rental costs per hour and per
million output tokens.

A replica's capacity is simulated, not assumed: the trace's requests all arriving at once
(an offline batch, so every decode step runs as full as the trace allows) on one replica
with the plan's buckets and step times; capacity = requests served / makespan. When the
arrival rate is above replicas x capacity the queue grows for as long as the trace lasts,
and a p99 measured in it is the trace's length, not a property of the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from neuronlocal.serve.sim import StepTimes, servable, simulate
from neuronlocal.serve.trace import Request


@dataclass(frozen=True)
class Capacity:
    rps: float  # requests per second one replica sustains on the trace's mix
    output_tps: float  # output tokens per second at that rate
    prompt_tps: float  # prompt tokens per second at that rate


def capacity(requests: Sequence[Request], ctx: Sequence[int], tg: Sequence[int],
             steps: StepTimes) -> Capacity:
    """One replica's sustained throughput on the servable requests of the trace."""
    ok = [Request(r.prompt, r.output) for r in requests if servable(r, sorted(ctx), sorted(tg))]
    if not ok:
        return Capacity(0.0, 0.0, 0.0)
    span = simulate(ok, ctx, tg, steps).makespan_s
    return Capacity(len(ok) / span, sum(r.output for r in ok) / span,
                    sum(r.prompt for r in ok) / span)


def arrival_rate(requests: Sequence[Request]) -> float | None:
    """Requests per second between the first and last arrival; None for an offline batch
    (every request at the same time)."""
    ts = [r.arrival for r in requests]
    span = max(ts) - min(ts)
    return (len(ts) - 1) / span if span > 0 else None


def keep_up(arrival_rps: float | None, cap: Capacity) -> int | None:
    """The fewest replicas whose capacity exceeds the arrival rate (None: offline)."""
    if arrival_rps is None or cap.rps <= 0:
        return None
    return math.floor(arrival_rps / cap.rps) + 1


@dataclass(frozen=True)
class Cost:
    per_hour: float | None  # USD for the instances rented
    per_million_output: float | None  # USD per million output tokens at the served rate
    served_output_tps: float  # output tokens per second the rental serves of this trace
    note: str


def cost(requests: Sequence[Request], cap: Capacity, replicas: int, instances: int,
         usd_per_hour: float | None, price_note: str) -> Cost:
    """The rental's price, and per million output tokens at the rate it serves this trace:
    the trace's own output rate, or the replicas' capacity when arrivals exceed it (or the
    trace is an offline batch)."""
    rate = arrival_rate(requests)
    top = replicas * cap.output_tps
    served = top
    if rate is not None:
        ts = [r.arrival for r in requests]
        served = min(top, sum(r.output for r in requests) / (max(ts) - min(ts)))
    if usd_per_hour is None:
        return Cost(None, None, served, price_note)
    hourly = usd_per_hour * instances
    per_m = hourly / (3600 * served) * 1e6 if served > 0 else None
    return Cost(hourly, per_m, served, price_note)


def hourly_price(instance: str, override: float | None = None) -> tuple[float | None, str]:
    """USD per instance-hour and what it rests on (estimate's dated price table)."""
    from neuronlocal.estimate.rates import PRICES_DATE, PRICES_REGION, price

    p = price(instance, override)
    if p is None:
        return None, f"no price known for {instance}; give --price-per-hour"
    if override is not None:
        return p.usd_per_hour, "price given with --price-per-hour"
    return p.usd_per_hour, (f"{instance} {PRICES_REGION}, price table of {PRICES_DATE}"
                            + ("" if p.verified else "; a third-party figure, not confirmed "
                               "by AWS"))
