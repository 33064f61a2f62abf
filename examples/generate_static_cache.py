"""Greedy generation with a static KV cache on neuron, auto-compiled by transformers.

transformers sees device `neuron` and compiles the decode step with backend "neuron",
dynamic=False (its own Trainium path). A tiny random Llama is saved to a temp dir, loaded with
`device_map="neuron"`, and its output is compared token for token with the same model on CPU.

    python examples/generate_static_cache.py [--new-tokens 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d)
        cpu = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
        dev = AutoModelForCausalLM.from_pretrained(d, device_map="neuron", dtype=dtype)
    prompt = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              cache_implementation="static")
    ref = cpu.generate(prompt, **kw)
    t = time.perf_counter()
    out = dev.generate(prompt.to("neuron"), **kw)
    first = time.perf_counter() - t
    before = torch.neuron.get_dynamo_metrics()["num_graphs"]
    t = time.perf_counter()
    dev.generate(prompt.to("neuron"), **kw)
    again = time.perf_counter() - t
    m = torch.neuron.get_dynamo_metrics()
    same = torch.equal(out.cpu(), ref)
    print(f"device {out.device}; first generate {first:.1f}s (compiles), again {again:.2f}s; "
          f"graphs {m['num_graphs']}, new graphs after warm-up "
          f"{m['num_graphs'] - before}")
    print("tokens match CPU:", same)
    if not same:
        raise SystemExit("neuron and CPU greedy outputs differ")


if __name__ == "__main__":
    main()
