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

Two cache layouts: NxD Inference's and vLLM-Neuron's (`static_cache=False`, the default), where
a decode step's graph is the smallest token bucket holding the longest active sequence, and
transformers' `generate` with a static cache (`static_cache=True`, what `--replay` runs), where
each request keeps the cache it was given at admission, the token bucket of its `kv_length`
(the padded prompt + output), for all its decode steps. Either needs a token bucket holding
the layout's `kv_length` (`servable`).

Step times are one table for every request, or (`own`, for a measured host whose speed varies
over time) one per request: a prefill takes its request's, a decode step the slowest of its
active requests', a finishing request adds its own `tail`.
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
    decode step of `batch` sequences with a KV cache of a length; `tail`: host seconds after a
    request's last token before its replica serves on (a measured host's `generate` returning;
    0 for the estimates, whose steps are back to back)."""

    prefill: Curve
    decode: Curve
    batch: int
    tail: float = 0.0


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


def kv_length(r: Request, ctx: Sequence[int], static_cache: bool = False) -> int:
    """The KV positions a request needs of its token bucket, decided here for the fit's
    default top bucket, the simulation and the replay alike: prompt + output in NxD
    Inference's and vLLM-Neuron's layout (its decode writes after the real prompt); with a
    static cache (`generate`) the prompt padded to its context bucket, left-padding included,
    plus output. `ctx` sorted; the prompt must fit it."""
    if static_cache:
        return ctx[bisect.bisect_left(ctx, r.prompt)] + r.output
    return r.prompt + r.output


def servable(r: Request, ctx: Sequence[int], tg: Sequence[int],
             static_cache: bool = False) -> bool:
    """A prompt must fit a context-encoding bucket and its `kv_length` a token bucket."""
    return r.prompt <= ctx[-1] and kv_length(r, ctx, static_cache) <= tg[-1]


class _Replica:
    """One replica's queue and batch; `advance(until)` takes every scheduling decision the
    replica makes before `until` (the next arrival anywhere, which may join it)."""

    def __init__(self, requests: Sequence[Request], ctx: list[int], tg: list[int],
                 steps: StepTimes, out: Sim, static_cache: bool,
                 own: Sequence[StepTimes] | None) -> None:
        self.requests, self.ctx, self.tg, self.steps, self.out = requests, ctx, tg, steps, out
        self.static, self.own = static_cache, own
        self.waiting: deque[int] = deque()
        # [request, cache length after next step, steps left, its static cache's length]
        self.active: list[list[int]] = []
        self.first: dict[int, float] = {}
        self.ends: list[float] = []  # finish times, kept while they may be in the future
        self.t = 0.0

    def load(self, t: float) -> int:
        """Requests dispatched here and not finished at `t` (join-shortest-queue's measure)."""
        while self.ends and self.ends[0] <= t:
            heapq.heappop(self.ends)
        return len(self.waiting) + len(self.active) + len(self.ends)

    def advance(self, until: float) -> None:
        out, requests, tg, own = self.out, self.requests, self.tg, self.own
        batch = self.steps.batch
        while (self.waiting or self.active) and self.t < until:
            if self.waiting and len(self.active) < batch:
                i = self.waiting.popleft()
                r = requests[i]
                steps = own[i] if own else self.steps
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
                    size = tg[bisect.bisect_left(tg, kv_length(r, self.ctx, self.static))]
                    self.active.append([i, r.prompt + 1, r.output - 1, size])
                else:
                    self.t += steps.tail
                    heapq.heappush(self.ends, self.t)
                continue
            active = self.active
            longest = max(a[1] for a in active)
            if self.static:  # each request's own cache; the step pads to the largest
                b = max(a[3] for a in active)
                n = min(a[2] for a in active)
            else:
                b = tg[bisect.bisect_left(tg, longest)]
                n = min(min(a[2] for a in active), b - longest + 1)
            steps = max((own[a[0]] for a in active), key=lambda x: x.decode(b)) if own \
                else self.steps
            dt = steps.decode(b)
            if len(active) < batch and until < math.inf:
                n = min(n, max(1, math.ceil((until - self.t) / dt)))
            self.t += n * dt
            out.busy_s += n * dt
            out.wasted_kv_s += n * (dt - steps.decode(longest + (n - 1) // 2))
            done = []
            for a in active:
                out.kv_used += n * a[1] + n * (n - 1) / 2
                out.kv_read += n * b
                a[1] += n
                a[2] -= n
                if a[2] == 0:
                    out.tpot.append((self.t - self.first[a[0]]) / (requests[a[0]].output - 1))
                    done.append(a)
            if done:
                self.t += max((own[a[0]] if own else self.steps).tail for a in done)
                for _ in done:
                    heapq.heappush(self.ends, self.t)
            self.active = [a for a in active if a[2] > 0]


def simulate(requests: Sequence[Request], ctx: Sequence[int], tg: Sequence[int],
             steps: StepTimes, replicas: int = 1, static_cache: bool = False,
             own: Sequence[StepTimes] | None = None) -> Sim:
    """Serve `requests` on `replicas` identical replicas; each arrival joins the replica with
    the fewest requests dispatched and not finished (join-shortest-queue, ties to the lowest
    index); a request no bucket serves is counted unservable and dropped at arrival. `own`:
    each request's step times, in `requests`' order (`steps` then gives only the batch)."""
    if own is not None and len(own) != len(requests):
        raise ValueError(f"{len(own)} step tables for {len(requests)} requests; give one each")
    ctx, tg = sorted(ctx), sorted(tg)
    out = Sim()
    reps = [_Replica(requests, ctx, tg, steps, out, static_cache, own)
            for _ in range(max(1, replicas))]
    for i in sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i)):
        r = requests[i]
        if not servable(r, ctx, tg, static_cache):
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
