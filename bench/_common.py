"""Shared helpers for benchmarks: timing and the tiny/large Llama configs of the issues."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], repeat: int = 5, warmup: int = 2) -> float:
    """Best wall time of `repeat` runs, in seconds, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def llama(hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 4),
                      num_key_value_heads=max(hidden // 128, 2), max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()
