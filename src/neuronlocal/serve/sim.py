"""The queueing simulation of a trace on estimated step times, for one bucket plan.

Each model replica serves its requests with continuous batching, as vLLM and NxD Inference do:
up to `batch` requests decode together; a waiting request is prefilled (alone, padded to its
context-encoding bucket) as soon as a decode slot is free, before the next decode step
(prefill first); each decode step runs every active request at the batch's compiled size,
padded to the smallest token-generation bucket that holds the longest active sequence. The
prompt's prefill produces the first token; a request of `output` tokens then takes
`output - 1` decode steps. Requests arrive at `arrival_s` (all at 0 when the trace has no
times: an offline batch, served in trace order). Steps between events (a request finishing,
a bucket boundary, an arrival that can take a free slot) are jumped over in one go, so a
simulation costs O(requests x (buckets + replicas)), not O(tokens). Several replicas take
the arrivals by join-shortest-queue (`simulate`).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from neuronlocal.serve.trace import Request


class Curve:
    """Seconds as a function of a length, interpolated between estimated points on log-log
    axes (exact for a power law between two points), flat beyond the ends."""

    def __init__(self, points: dict[int, float]) -> None:
        self.xs = sorted(points)
        self.ys = [points[x] for x in self.xs]
        self._memo: dict[int, float] = {}

    def __call__(self, x: int) -> float:
        if x in self._memo:
            return self._memo[x]
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            y = ys[0]
        elif x >= xs[-1]:
            y = ys[-1]
        else:
            i = bisect.bisect_left(xs, x)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            f = math.log(x / x0) / math.log(x1 / x0)
            y = math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
        self._memo[x] = y
        return y


@dataclass
class StepTimes:
    """Estimated seconds of one prefill of a prompt padded to a length (batch 1) and of one
    decode step of `batch` sequences with a KV cache of a length."""

    prefill: Curve
    decode: Curve
    batch: int


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least q% of values at or below)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass
class Sim:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    unservable: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled
    padded_tokens: int = 0  # prompt tokens after padding to buckets
    padding_s: float = 0.0  # prefill seconds spent on padding
    kv_used: float = 0.0  # KV positions decode steps needed (active sequences)
    kv_read: float = 0.0  # KV positions they read at their bucket
    wasted_kv_s: float = 0.0  # decode seconds spent reading the padding
    busy_s: float = 0.0
    makespan_s: float = 0.0

    @property
    def padding_fraction(self) -> float:
        return 1 - self.prefill_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def kv_waste_fraction(self) -> float:
        return 1 - self.kv_used / self.kv_read if self.kv_read else 0.0


def servable(r: Request, ctx: Sequence[int], tg: Sequence[int]) -> bool:
    """A prompt must fit a context-encoding bucket and prompt + output a token-generation
    bucket (the KV cache holds every token, as NxD Inference's seq_len does)."""
    return r.prompt <= ctx[-1] and r.prompt + r.output <= tg[-1]


class _Replica:
    """One replica's queue and batch; `advance(until)` takes every scheduling decision the
    replica makes before `until` (the next arrival anywhere, which may join it)."""

    def __init__(self, requests: Sequence[Request], ctx: list[int], tg: list[int],
                 steps: StepTimes, out: Sim) -> None:
        self.requests, self.ctx, self.tg, self.steps, self.out = requests, ctx, tg, steps, out
        self.waiting: deque[int] = deque()
        self.active: list[list[int]] = []  # [request, cache length after next step, steps left]
        self.first: dict[int, float] = {}
        self.ends: list[float] = []  # finish times, kept while they may be in the future
        self.t = 0.0

    def load(self, t: float) -> int:
        """Requests dispatched here and not finished at `t` (join-shortest-queue's measure)."""
        while self.ends and self.ends[0] <= t:
            heapq.heappop(self.ends)
        return len(self.waiting) + len(self.active) + len(self.ends)

    def advance(self, until: float) -> None:
        out, steps, requests, tg = self.out, self.steps, self.requests, self.tg
        while (self.waiting or self.active) and self.t < until:
            if self.waiting and len(self.active) < steps.batch:
                i = self.waiting.popleft()
                r = requests[i]
                b = self.ctx[bisect.bisect_left(self.ctx, r.prompt)]
                dt = steps.prefill(b)
                self.t += dt
                out.busy_s += dt
                out.prefill_tokens += r.prompt
                out.padded_tokens += b
                out.padding_s += dt - steps.prefill(r.prompt)
                out.ttft.append(self.t - r.arrival)
                self.first[i] = self.t
                if r.output > 1:
                    self.active.append([i, r.prompt + 1, r.output - 1])
                else:
                    heapq.heappush(self.ends, self.t)
                continue
            active = self.active
            longest = max(a[1] for a in active)
            b = tg[bisect.bisect_left(tg, longest)]
            dt = steps.decode(b)
            n = min(min(a[2] for a in active), b - longest + 1)
            if len(active) < steps.batch and until < math.inf:
                n = min(n, max(1, math.ceil((until - self.t) / dt)))
            self.t += n * dt
            out.busy_s += n * dt
            out.wasted_kv_s += n * (dt - steps.decode(longest + (n - 1) // 2))
            for a in active:
                out.kv_used += n * a[1] + n * (n - 1) / 2
                out.kv_read += n * b
                a[1] += n
                a[2] -= n
                if a[2] == 0:
                    out.tpot.append((self.t - self.first[a[0]]) / (requests[a[0]].output - 1))
                    heapq.heappush(self.ends, self.t)
            self.active = [a for a in active if a[2] > 0]


def simulate(requests: Sequence[Request], ctx: Sequence[int], tg: Sequence[int],
             steps: StepTimes, replicas: int = 1) -> Sim:
    """Serve `requests` on `replicas` identical replicas; each arrival joins the replica with
    the fewest requests dispatched and not finished (join-shortest-queue, ties to the lowest
    index); a request no bucket serves is counted unservable and dropped at arrival."""
    ctx, tg = sorted(ctx), sorted(tg)
    out = Sim()
    reps = [_Replica(requests, ctx, tg, steps, out) for _ in range(max(1, replicas))]
    for i in sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i)):
        r = requests[i]
        if not servable(r, ctx, tg):
            out.unservable += 1
            continue
        for rep in reps:
            rep.advance(r.arrival)
        rep = min(reps, key=lambda x: x.load(r.arrival))
        rep.t = max(rep.t, r.arrival)
        rep.waiting.append(i)
    for rep in reps:
        rep.advance(math.inf)
    out.makespan_s = max(rep.t for rep in reps)
    return out
