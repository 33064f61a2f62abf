"""Greedy generation of a Llama-3-70B-shaped model at TP=32 with a static KV cache, for
`neuronlocal run --dry-run`.

Megatron-style DTensor TP over all ranks (`parallelize_module`): q, gate and up column-wise,
o and down row-wise (one all-reduce each), the embedding row-wise, the LM head column-wise
gathered to whole logits. Llama-3-70B has 8 KV heads for 64 query heads, fewer than the 32
ranks, so each rank holds the one KV head its 2 query heads use (its k and v projections
replicated over the 4 ranks that share it, as NxD Inference replicates KV heads when TP
exceeds them) and a static cache of that head: [batch, 1, max_len, 128] per layer for k and
v, written in place (`index_copy_`) at each position. bf16 weights built on `meta`,
sharded, then materialised on the device.

The run report's estimate cuts a run into steps at `optimizer.step()`; generation has no
optimizer, so after the model is built, after the prefill and after each decode step the
script steps an SGD over one neuron scalar (it updates nothing: its gradient is None). The
report's steps are then: the build, the prefill, and one per decode step (`step_s` is the
last decode step's).

    neuronlocal run --dry-run --instance trn2.48xlarge --nproc-per-node 32 --steps 0 \
        --ranks 0 bench/dry_run_generate_tp.py

`--layers` etc. shrink it (a test runs it at 2 layers on 4 ranks).
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """One decoder layer holding this rank's share: q/o/gate/up/down are sharded by
    `shard`; k and v project to the rank's one KV head."""

    def __init__(self, d: int, heads: int, ffn: int, batch: int, max_len: int) -> None:
        super().__init__()
        self.hd = d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, self.hd, bias=False)  # this rank's KV head, replicated
        self.v = nn.Linear(d, self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)
        self.register_buffer("k_cache", torch.zeros(batch, 1, max_len, self.hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, 1, max_len, self.hd), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        """`pos`: the positions of x's tokens; `end`: the cache's filled length after them."""
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, -1, self.hd).transpose(1, 2)  # the rank's query heads
        self.k_cache.index_copy_(2, pos, self.k(h).view(b, s, 1, self.hd).transpose(1, 2))
        self.v_cache.index_copy_(2, pos, self.v(h).view(b, s, 1, self.hd).transpose(1, 2))
        k, v = self.k_cache[:, :, :end], self.v_cache[:, :, :end]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, batch: int,
                 max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, ffn, batch, max_len)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, end: int) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pos, end)
        return self.head(self.norm(x[:, -1:]))  # the last position's logits only


def shard(model: Llama, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in model.layers:
        parallelize_module(layer, mesh, {"q": ColwiseParallel(), "o": RowwiseParallel(),
                                         "gate": ColwiseParallel(), "up": ColwiseParallel(),
                                         "down": RowwiseParallel()})
    parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                     "head": ColwiseParallel(output_layouts=Replicate())})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=4, help="tokens to generate")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-len", type=int, default=4096, help="static cache length")
    a = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("neuron")
    tp = dist.get_world_size()
    if a.heads % tp or tp % a.kv:
        raise SystemExit(f"the world size ({tp}) must divide the heads ({a.heads}) and be a "
                         f"multiple of the KV heads ({a.kv})")
    if a.prompt + a.new > a.max_len:
        raise SystemExit(f"--prompt {a.prompt} + --new {a.new} exceeds --max-len {a.max_len}")
    mesh = init_device_mesh("neuron", (tp,))
    t0 = time.time()
    with torch.device("meta"):
        model = Llama(a.vocab, a.hidden, a.layers, a.heads, a.ffn, a.batch,
                      a.max_len).to(torch.bfloat16)
    shard(model, mesh)
    model.to_empty(device="neuron")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        for layer in model.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()
    boundary = torch.optim.SGD([torch.zeros((), device="neuron", requires_grad=True)], lr=0.0)
    boundary.step()  # the build ends the first step
    ids = torch.randint(0, a.vocab, (a.batch, a.prompt), device="neuron")
    out = []
    with torch.no_grad():
        pos = torch.arange(a.prompt, device="neuron")
        for i in range(a.new):
            end = a.prompt + i
            nxt = model(ids, pos, end).argmax(-1)
            boundary.step()  # the prefill, then each decode step
            out.append(nxt)
            ids, pos = nxt, torch.tensor([end], device="neuron")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"rank {dist.get_rank()}: {len(out)} tokens, peak HBM "
          f"{torch.neuron.max_memory_allocated() / 2**30:.2f} GiB, host peak RSS {rss:.2f} GiB, "
          f"{time.time() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
