"""The queueing simulation checked against measured serving: the requests a replay served, as
timed, go through `simulate` with the replay's scheduler (one replica, batch 1, first come
first served, each request decoding in its own static cache: `simulate(...,
static_cache=True)`), at the replay's arrival times, and the simulated TTFT and TPOT (p50,
p99) are set next to the measured ones.

Twice, on two sets of step times from the same measurements: each request's own service
(`own_steps`; it checks the queue, the scheduler and its step counts while the host's speed
drifts with other jobs), and one median per bucket (`host_steps`, the planner's abstraction;
medians, so one slow step does not move a whole bucket): per context bucket the time from
`generate`'s call to the first token (padding and the cache's reset are serving time), per
static-cache size the gap between two consecutive tokens. Both carry the host's time after a
request's last token until it takes the next one (`StepTimes.tail`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from neuronlocal.serve.sim import Curve, Sim, StepTimes, percentile, simulate
from neuronlocal.serve.trace import Request

GOAL = 0.15  # the agreement asked of the simulation, relative


@dataclass(frozen=True)
class Served:
    """One request as the host served it; times in seconds from the replay's start."""

    request: Request  # arrival is the (rescaled) time it arrived at
    bucket: int  # its context bucket
    cache: int  # its static cache's length (a token bucket)
    start: float  # generate called
    tokens: tuple[float, ...]  # each output token's time, the first from the prefill
    end: float  # generate returned

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.request.arrival

    @property
    def tpot(self) -> float | None:
        t = self.tokens
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def _tails(served: Sequence[Served]) -> list[float]:
    """Host seconds from each request's last token until it took the next one (when that one
    was waiting), else until generate returned."""
    out = []
    for s, nxt in zip(served, [*served[1:], None], strict=True):
        waited = nxt is not None and nxt.request.arrival <= s.end
        out.append((nxt.start if nxt is not None and waited else s.end) - s.tokens[-1])
    return out


def host_steps(served: Sequence[Served], fallback: StepTimes | None = None) -> StepTimes:
    """Median step times of the served requests' samples, one per bucket (the planner's
    abstraction); `fallback` (the replay's calibration) fills a bucket no request used."""
    pre: dict[int, list[float]] = {}
    dec: dict[int, list[float]] = {}
    for s in served:
        pre.setdefault(s.bucket, []).append(s.tokens[0] - s.start)
        dec.setdefault(s.cache, []).extend(b - a for a, b in pairwise(s.tokens))
    prefill = {b: fallback.prefill(b) for b in fallback.prefill.xs} if fallback else {}
    decode = {c: fallback.decode(c) for c in fallback.decode.xs} if fallback else {}
    prefill.update({b: statistics.median(v) for b, v in pre.items()})
    decode.update({c: statistics.median(v) for c, v in dec.items() if v})
    tails = _tails(served)
    return StepTimes(Curve(prefill or {1: 0.0}), Curve(decode or {1: 0.0}), 1,
                     statistics.median(tails) if tails else 0.0)


def own_steps(served: Sequence[Served]) -> list[StepTimes]:
    """Each request's own measured service: its prefill (generate's call to the first token),
    its decode seconds over its decode steps, its tail; the host's speed drifts over a run
    (other jobs), and this follows it request by request."""
    return [StepTimes(Curve({s.bucket: s.tokens[0] - s.start}),
                      Curve({s.cache: s.tpot if s.tpot is not None else 0.0}), 1, tail)
            for s, tail in zip(served, _tails(served), strict=True)]


def ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 of seconds, in milliseconds."""
    return {q: None if (v := percentile(values, n)) is None else round(v * 1e3, 3)
            for q, n in (("p50", 50), ("p99", 99))}


def _rel(sim: float | None, measured: float | None) -> float | None:
    return None if sim is None or not measured else round(sim / measured - 1, 4)


def _compare(served: Sequence[Served], sim: Sim) -> dict[str, Any]:
    tpots = [t for s in served if (t := s.tpot) is not None]
    out: dict[str, Any] = {"host_ttft_ms": ms([s.ttft for s in served]),
                           "host_tpot_ms": ms(tpots), "simulated_ttft_ms": ms(sim.ttft),
                           "simulated_tpot_ms": ms(sim.tpot)}
    out["relative_error"] = {f"{k}_{q}": _rel(out[f"simulated_{k}_ms"][q],
                                              out[f"host_{k}_ms"][q])
                             for k in ("ttft", "tpot") for q in ("p50", "p99")}
    errs = [e for e in out["relative_error"].values() if e is not None]
    out["within_goal"] = bool(errs) and all(abs(e) <= GOAL for e in errs)
    return out


def check(served: Sequence[Served], ctx: Sequence[int], tg: Sequence[int],
          fallback: StepTimes | None = None) -> dict[str, Any]:
    """The simulation of `served` next to their measured latencies, twice: on each request's
    own measured service (`own_steps`: checks the queue, the scheduler and its step counts),
    and on one median step time per bucket (`host_steps`: the planner's abstraction, exact
    when the host's speed holds). Each gives TTFT and TPOT p50/p99 (ms) and the relative
    errors (simulated / measured - 1) against GOAL."""
    steps = host_steps(served, fallback)
    reqs = [s.request for s in served]
    own = simulate(reqs, ctx, tg, steps, static_cache=True, own=own_steps(served))
    med = simulate(reqs, ctx, tg, steps, static_cache=True)
    tpots = [t for s in served if (t := s.tpot) is not None]
    return {"goal": GOAL, "own_steps": _compare(served, own),
            "bucket_medians": {
                **_compare(served, med),
                "prefill_ms": {b: round(steps.prefill(b) * 1e3, 3) for b in steps.prefill.xs},
                "decode_ms": {c: round(steps.decode(c) * 1e3, 3) for c in steps.decode.xs},
                "after_last_token_ms": round(steps.tail * 1e3, 3)},
            "host_tpot_spread": None if not tpots or not statistics.median(tpots) else
            round(max(tpots) / statistics.median(tpots) - 1, 4),
            "unservable": own.unservable}
