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

import time
from collections.abc import Sequence
from typing import Any

import torch

from neuronlocal.serve.sim import StepTimes, percentile
from neuronlocal.serve.trace import Request


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


def _ms(values: list[float]) -> dict[str, float | None]:
    return {q: None if (v := percentile(values, n)) is None else round(v * 1e3, 3)
            for q, n in (("p50", 50), ("p99", 99))}


def replay(folder: str, requests: Sequence[Request], ctx: list[int], tg: list[int],
           steps: StepTimes) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, StaticCache

    from neuronlocal.compile.bucketing import bucket_for, pad_to_bucket

    cpu = AutoModelForCausalLM.from_pretrained(folder).eval()
    dev = AutoModelForCausalLM.from_pretrained(folder, device_map="neuron").eval()
    pad = int(cpu.config.pad_token_id or 0)
    caches: dict[int, Any] = {}

    def generate(ids: torch.Tensor, new: int) -> tuple[torch.Tensor, _Clock, int, int, float]:
        padded, mask = pad_to_bucket(ids, ctx, pad, side="left")
        size = bucket_for(padded.shape[-1] + new, tg)
        if size not in caches:
            caches[size] = StaticCache(config=dev.config, max_cache_len=size)
        cache = caches[size]
        cache.reset()
        clock = _Clock()
        start = time.perf_counter()
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
    warmed = []
    start_graphs = dynamo_metrics.next_graph_id()  # counts graphs without estimating them
    for size in tg:  # one decode graph per token bucket, reached from the smallest prompt
        b = next((b for b in ctx if b + 2 <= size), None)
        if b is not None:
            generate(torch.randint(0, vocab, (1, b), generator=gen), 2)
            warmed.append(size)
    for b in ctx:  # every context bucket's prefill, into the smallest cache that holds it
        if any(b + 2 <= size for size in tg):
            generate(torch.randint(0, vocab, (1, b), generator=gen), 2)
    before = dynamo_metrics.next_graph_id()
    ttft, tpot, est_ttft, est_tpot, matches, skipped = [], [], [], [], [], 0
    error = None
    with torch.compiler.set_stance("fail_on_recompile"):
        for r in requests:
            b = bucket_for(r.prompt, ctx) if r.prompt <= ctx[-1] else None
            if b is None or b + r.output > tg[-1]:
                skipped += 1  # generate's cache holds the padded prompt: no token bucket fits
                continue
            ids = torch.randint(0, vocab, (1, r.prompt), generator=gen)
            try:
                tokens, clock, b, size, start = generate(ids, r.output)
            except Exception as e:  # noqa: BLE001 - a recompile under the stance, reported
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                break
            ref = cpu.generate(ids, max_new_tokens=r.output, min_new_tokens=r.output,
                               do_sample=False)[0, r.prompt:]
            matches.append(bool(torch.equal(tokens, ref)))
            ttft.append(clock.times[0] - start)
            if len(clock.times) > 1:
                tpot.append((clock.times[-1] - clock.times[0]) / (len(clock.times) - 1))
            est_ttft.append(steps.prefill(b))
            est_tpot.append(steps.decode(size))
    after = dynamo_metrics.next_graph_id()
    return {"requests": len(matches), "skipped_no_bucket": skipped,
            "graphs_warmed": before - start_graphs,
            "token_buckets_warmed": warmed,
            "recompiles_after_warmup": after - before,
            "error": error, "outputs_match": bool(matches) and all(matches),
            "host_ttft_ms": _ms(ttft), "host_tpot_ms": _ms(tpot),
            "estimated_ttft_ms": _ms(est_ttft), "estimated_tpot_ms": _ms(est_tpot)}
