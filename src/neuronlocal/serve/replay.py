"""`serve-plan --replay N`: the plan applied on neuron, as its generate config says.

The first N requests of the trace run one after another (batch 1) through transformers'
`generate` on a local model folder loaded on neuron: random prompt tokens of each request's
length, left-padded to its context bucket, one reused StaticCache per token bucket (padded
prompt + output must fit it), greedy decoding for exactly its output length. Every bucket is
warmed first; then the requests run under `torch.compiler.set_stance("fail_on_recompile")`,
so a compile after warm-up is an error, and the graphs compiled (or loaded from the cache)
after warm-up are counted. Each request's tokens are checked against the same model on CPU,
unpadded, without a static cache (padding and cache must not change the answer). Host
latencies are this machine's; the estimates next to them are Trainium's (prefill at the
bucket, one decode step at the plan's batch), without queueing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from neuronlocal.serve.sim import Curve, StepTimes, kv_length, servable
from neuronlocal.serve.trace import Request
from neuronlocal.serve.validate import Served, check, ms

CALIBRATION_RUNS = 3
DECODE_TOKENS = 8  # decode steps a calibration run times, at least
HOST_UTILISATION = 0.6


class _Clock:
    """A generate streamer that timestamps each new token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def replay(folder: str, requests: Sequence[Request], ctx: list[int], tg: list[int],
           steps: StepTimes) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, StaticCache

    from neuronlocal.compile.bucketing import bucket_for, pad_to_bucket

    cpu = AutoModelForCausalLM.from_pretrained(folder).eval()
    dev = AutoModelForCausalLM.from_pretrained(folder, device_map="neuron").eval()
    pad = int(cpu.config.pad_token_id or 0)
    caches: dict[int, Any] = {}

    def generate(ids: torch.Tensor, new: int) -> tuple[torch.Tensor, _Clock, int, int, float]:
        start = time.perf_counter()  # padding and the cache's reset are serving time too
        padded, mask = pad_to_bucket(ids, ctx, pad, side="left")
        size = bucket_for(padded.shape[-1] + new, tg)
        if size not in caches:
            caches[size] = StaticCache(config=dev.config, max_cache_len=size)
        cache = caches[size]
        cache.reset()
        clock = _Clock()
        out = dev.generate(padded.to("neuron"), attention_mask=mask.to("neuron"), cache=cache,
                           max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           streamer=clock)
        return out[0, padded.shape[-1]:].cpu(), clock, padded.shape[-1], size, start

    limit = max(torch._dynamo.config.recompile_limit, len(tg) + 2)
    with torch._dynamo.config.patch(recompile_limit=limit):
        return _serve(cpu, generate, requests, ctx, tg, steps)


def _serve(cpu: Any, generate: Any, requests: Sequence[Request], ctx: list[int],
           tg: list[int], steps: StepTimes) -> dict[str, Any]:
    from neuronlocal.compile.bucketing import bucket_for
    from neuronlocal.core import dynamo_metrics

    gen = torch.Generator().manual_seed(0)
    vocab = int(cpu.config.vocab_size)

    def prompt(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, n), generator=gen)

    start_graphs = dynamo_metrics.next_graph_id()  # counts graphs without estimating them
    host, warmed = _calibrate(generate, prompt, ctx, tg)
    before = dynamo_metrics.next_graph_id()
    served: list[tuple[Request, int, int, torch.Tensor]] = []
    skipped = 0
    for r in requests:
        if not servable(r, ctx, tg, static_cache=True):
            skipped += 1  # generate's cache holds the padded prompt: no token bucket fits
            continue
        b = bucket_for(r.prompt, ctx)
        size = bucket_for(kv_length(r, ctx, static_cache=True), tg)
        served.append((r, b, size, prompt(r.prompt)))
    arrivals = _host_arrivals([r for r, *_ in served], [b for _, b, *_ in served],
                              [size for *_, size, _ in served], host)
    outs: list[torch.Tensor] = []
    done: list[Served] = []
    error = None
    with torch.compiler.set_stance("fail_on_recompile"):
        t0 = time.perf_counter()
        for (r, *_, ids), a in zip(served, arrivals, strict=True):
            time.sleep(max(0.0, t0 + a - time.perf_counter()))  # the request arrives
            try:
                tokens, clock, b, size, start = generate(ids, r.output)
            except Exception as e:  # noqa: BLE001 - a recompile under the stance, reported
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            end = time.perf_counter()
            outs.append(tokens)
            done.append(Served(Request(r.prompt, r.output, a), b, size, start - t0,
                               tuple(t - t0 for t in clock.times), end - t0))
    after = dynamo_metrics.next_graph_id()
    matches = [bool(torch.equal(tokens, cpu.generate(
        ids, max_new_tokens=r.output, min_new_tokens=r.output, do_sample=False)[0, r.prompt:]))
        for tokens, (r, *_, ids) in zip(outs, served, strict=False)]
    q = check(done, ctx, tg, host) if done else None
    return {"requests": len(matches), "skipped_no_bucket": skipped,
            "graphs_warmed": before - start_graphs,
            "token_buckets_warmed": warmed,
            "recompiles_after_warmup": after - before,
            "error": error, "outputs_match": bool(matches) and all(matches),
            "host_ttft_ms": ms([d.ttft for d in done]),
            "host_tpot_ms": ms([t for d in done if (t := d.tpot) is not None]),
            "arrivals_s": [round(a, 6) for a in arrivals], "queueing_check": q,
            "estimated_ttft_ms": ms([steps.prefill(b) for _, b, *_ in served]),
            "estimated_tpot_ms": ms([steps.decode(size) for *_, size, _ in served])}


def _calibrate(generate: Any, prompt: Any, ctx: list[int], tg: list[int]
               ) -> tuple[StepTimes, list[int]]:
    """Warm every graph, then time it: each context bucket's prefill (the time to the first
    token, generate's setup included) and each token bucket's decode step, landed on by a
    prompt of the smallest context bucket and enough new tokens to need that cache; prompts
    are padded (half-way between buckets), as the trace's are. Each is
    timed CALIBRATION_RUNS times after a warm-up run; the median is kept."""
    from neuronlocal.compile.bucketing import bucket_for

    def timed(b: int, new: int) -> list[tuple[float, float]]:
        below = max([0, *(c for c in ctx if c < b)])
        ids = prompt(b - (b - below) // 2)  # left-padded to b, as most requests are
        runs = []
        for _ in range(CALIBRATION_RUNS + 1):
            _, clock, _, _, start = generate(ids, new)
            t = clock.times
            runs.append((t[0] - start, (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0))
        return runs[1:]

    pre: dict[int, float] = {}
    dec: dict[int, float] = {}
    for i, size in enumerate(tg):
        b = ctx[0]
        new = max((tg[i - 1] if i else 0) + 1 - b, min(DECODE_TOKENS, size - b))
        if new >= 2 and b + new <= size and bucket_for(b + new, tg) == size:
            dec[size] = statistics.median(tpot for _, tpot in timed(b, new))
    for b in ctx:
        if b + 2 <= tg[-1]:
            pre[b] = statistics.median(ttft for ttft, _ in timed(b, 2))
    warmed = sorted(dec)
    return StepTimes(Curve(pre or {1: 0.0}), Curve(dec or {1: 0.0}), 1), warmed


def _host_arrivals(reqs: list[Request], ctx_of: list[int], size_of: list[int],
                   host: StepTimes) -> list[float]:
    """The trace's arrival times, rescaled so the host is HOST_UTILISATION busy serving them
    one at a time (unscaled, a Trainium trace would be all queue on the host); all at 0 for
    an offline batch."""
    if not reqs:
        return []
    first = min(r.arrival for r in reqs)
    span = max(r.arrival for r in reqs) - first
    if span <= 0 or len(reqs) < 2:
        return [0.0] * len(reqs)
    service = sum(host.prefill(b) + (r.output - 1) * host.decode(size)
                  for r, b, size in zip(reqs, ctx_of, size_of, strict=True)) / len(reqs)
    scale = service / HOST_UTILISATION / (span / (len(reqs) - 1))
    return [(r.arrival - first) * scale for r in reqs]
