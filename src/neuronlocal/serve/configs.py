"""A plan as configs to paste: NxD Inference, vLLM-Neuron, and transformers' generate with
`neuronlocal.compile.bucketing`.

Option names are the documented ones: NxD Inference's NeuronConfig (`enable_bucketing`,
`context_encoding_buckets`, `token_generation_buckets`; feature guide, "Bucketing") and
vLLM-Neuron's `additional_config["neuron_config"]` (`num_batched_tokens_buckets`: prefill
token counts, the largest equal to `max_num_batched_tokens`; `num_seqs_buckets`: decode batch
sizes, the largest equal to `max_num_seqs`; `decode_context_length_buckets`: decode KV
lengths, multiples of 128 strictly below `max_model_len`, whose graph is always compiled).
"""

from __future__ import annotations

import json
from typing import Any


def nxd_inference(ctx: list[int], tg: list[int], batch: int) -> dict[str, Any]:
    """NeuronConfig keyword arguments (also vLLM's `override_neuron_config` on NxD Inference)."""
    return {"batch_size": batch, "seq_len": tg[-1], "max_context_length": ctx[-1],
            "enable_bucketing": True, "context_encoding_buckets": ctx,
            "token_generation_buckets": tg}


def vllm_neuron(ctx: list[int], tg: list[int], batch: int) -> dict[str, Any]:
    """`vllm serve` arguments and `--additional-config` of the vLLM-Neuron plugin."""
    neuron: dict[str, Any] = {"num_batched_tokens_buckets": ctx, "num_seqs_buckets": [batch]}
    below = [b for b in tg if b < tg[-1]]
    if below:
        neuron["decode_context_length_buckets"] = below
    return {"max_model_len": tg[-1], "max_num_seqs": batch, "max_num_batched_tokens": ctx[-1],
            "additional_config": {"neuron_config": neuron}}


def generate_snippet(ctx: list[int], tg: list[int]) -> str:
    """transformers' generate on neuron: prompts left-padded to a context bucket, one static
    cache per token bucket (its decode graph compiles once), chosen for padded prompt +
    new tokens."""
    return "\n".join([
        "from transformers import StaticCache",
        "from neuronlocal.compile.bucketing import bucket_for, pad_to_bucket",
        f"CONTEXT_BUCKETS = {ctx}",
        f"TOKEN_BUCKETS = {tg}",
        "caches = {}  # one StaticCache per token bucket, reused: one decode graph each",
        "ids, mask = pad_to_bucket(input_ids, CONTEXT_BUCKETS, pad_id, side='left')",
        "size = bucket_for(ids.shape[-1] + max_new_tokens, TOKEN_BUCKETS)",
        "cache = caches.get(size) or caches.setdefault(size, StaticCache(",
        "    config=model.config, max_cache_len=size))",
        "cache.reset()",
        "# transformers >= 5 (past_key_values=cache before it)",
        "out = model.generate(ids, attention_mask=mask, cache=cache,",
        "                     max_new_tokens=max_new_tokens)",
    ])


def render(ctx: list[int], tg: list[int], batch: int) -> str:
    nxd = nxd_inference(ctx, tg, batch)
    vl = vllm_neuron(ctx, tg, batch)
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vl.items()
                    if k != "additional_config")
    return "\n".join([
        "NxD Inference (NeuronConfig, or vLLM's override_neuron_config on NxD Inference):",
        f"  NeuronConfig(**{json.dumps(nxd)})",
        "vLLM-Neuron plugin:",
        f"  vllm serve MODEL {args} \\",
        f"    --additional-config '{json.dumps(vl['additional_config'])}'",
        "transformers generate on neuron (neuronlocal.compile.bucketing):",
        *("  " + line for line in generate_snippet(ctx, tg).splitlines()),
    ])
