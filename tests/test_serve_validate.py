"""The queueing simulation against measured serving (`serve.validate`), on schedules built by
hand the way the replay's host serves: one request at a time, first come first served, each
in its own static cache, with host time after its last token; and the static-cache layout,
the host tail and per-request step tables of `simulate` itself."""

from __future__ import annotations

import random

import pytest

from neuronlocal.serve import validate as V
from neuronlocal.serve.sim import Curve, StepTimes, kv_length, simulate
from neuronlocal.serve.trace import Request

CTX, TG = [128, 256], [256, 384]


def _host(reqs: list[Request], speed: list[float], prefill: float = 0.05,
          step: float = 0.01, tail: float = 0.002) -> list[V.Served]:
    """What a host serving one request at a time measures; `speed` slows each request."""
    out, free = [], 0.0
    for r, k in zip(reqs, speed, strict=True):
        start = max(r.arrival, free)
        b = min(c for c in CTX if c >= r.prompt)
        first = start + prefill * k * b / 128
        tokens = tuple(first + i * step * k for i in range(r.output))
        out.append(V.Served(r, b, min(c for c in TG if c >= b + r.output), start, tokens,
                            tokens[-1] + tail))
        free = tokens[-1] + tail
    return out


def _trace(n: int = 40, seed: int = 5) -> list[Request]:
    rng, t, reqs = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.5)
        reqs.append(Request(rng.randint(10, 250), rng.randint(2, 60), t))
    return reqs


def test_steady_host_is_predicted_by_bucket_medians():
    """A host whose speed holds: one median per bucket is the whole story, to the rounding."""
    served = _host(_trace(), [1.0] * 40)
    q = V.check(served, CTX, TG)
    for mode in ("own_steps", "bucket_medians"):
        errors = q[mode]["relative_error"]
        assert all(abs(e) < 1e-3 for e in errors.values()), (mode, errors)
        assert q[mode]["within_goal"]
    assert q["bucket_medians"]["prefill_ms"] == {128: 50.0, 256: 100.0}
    assert q["bucket_medians"]["after_last_token_ms"] == pytest.approx(2.0)
    assert q["host_tpot_spread"] == pytest.approx(0.0, abs=1e-9)
    assert q["own_steps"]["host_ttft_ms"]["p99"] > 3 * q["own_steps"]["host_ttft_ms"]["p50"]


def test_drifting_host_is_predicted_request_by_request():
    """Other jobs slow the host for a while: the medians miss the queue that builds, each
    request's own service does not."""
    reqs = _trace()
    served = _host(reqs, [2.0 if 10 <= i < 20 else 1.0 for i in range(len(reqs))])
    q = V.check(served, CTX, TG)
    assert all(abs(e) < 1e-3 for e in q["own_steps"]["relative_error"].values())
    assert not q["bucket_medians"]["within_goal"] and q["host_tpot_spread"] == pytest.approx(1.0)


def test_the_check_fails_a_simulation_without_the_host_tail():
    """A modelling gap shows: the host's 30 ms after each last token, left out, queues less."""
    served = _host(_trace(), [1.0] * 40, tail=0.03)
    q = V.check(served, CTX, TG)
    assert q["own_steps"]["within_goal"]
    without = [StepTimes(s.prefill, s.decode, 1) for s in V.own_steps(served)]
    sim = simulate([s.request for s in served], CTX, TG, without[0], static_cache=True,
                   own=without)
    assert not V._compare(served, sim)["within_goal"]


def test_static_cache_decodes_in_the_cache_chosen_at_admission():
    """generate's layout: a request whose padded prompt + output needs 384 decodes every step
    at 384; NxD Inference's runs at the smallest bucket holding the current length."""
    steps = StepTimes(Curve({128: 0.0, 384: 0.0}), Curve({256: 0.001, 384: 0.002}), 1)
    r = [Request(100, 160)]  # padded to 128 + 160 = 288: the 384 cache; lengths 101-259
    assert kv_length(r[0], CTX, static_cache=True) == 288 and kv_length(r[0], CTX) == 260
    assert simulate(r, CTX, TG, steps, static_cache=True).tpot == pytest.approx([0.002])
    nxd = simulate(r, CTX, TG, steps).tpot[0]  # lengths 101-256 at 256, 257-259 at 384
    assert nxd == pytest.approx((156 * 0.001 + 3 * 0.002) / 159)


def test_own_steps_need_one_table_per_request():
    steps = StepTimes(Curve({128: 0.01}), Curve({256: 0.001}), 1)
    with pytest.raises(ValueError, match="one each"):
        simulate([Request(10, 2)] * 2, CTX, TG, steps, own=[steps])


def test_default_top_token_bucket_holds_the_padded_prompt_and_output():
    """One rule for the KV a request needs: the default top token bucket holds each prompt
    padded to its baseline context bucket plus its output, so the replay (a static cache)
    serves every request the simulation does; the trace's prompt + output rounded up (384
    here) would leave the long one to the replay's skip list."""
    from neuronlocal.serve import plan as P
    from neuronlocal.serve.sim import servable

    reqs = [Request(130, 200), Request(20, 5)]
    top = P.default_max_len(reqs)
    ctx, tg = P.baseline(P.longest(reqs, top)[1], top)
    assert (ctx, top) == ([128, 256], 512)
    assert all(servable(r, ctx, tg, static_cache=True) and servable(r, ctx, tg) for r in reqs)
    short = P.baseline(256, 384)[1]
    assert servable(reqs[0], ctx, short) and not servable(reqs[0], ctx, short, static_cache=True)
    f = P.fit(reqs, StepTimes(Curve({16: 0.01, 512: 0.02}), Curve({16: 0.001, 512: 0.002}), 1),
              top, None)
    assert f.plan.tg[-1] == f.baseline.tg[-1] == 512 and f.plan.sim.unservable == 0
