"""A Llama-3-8B-shaped FSDP2 training step, for `neuronlocal run --dry-run`.

The model is built on `meta`, sharded with FSDP2 per decoder layer, materialised on the
device shard by shard (`to_empty`, then each module's `reset_parameters`, as torchtitan
does), and trained with AdamW in bf16 for a few steps on random tokens. `--init device`
builds it whole on the device first instead (`torch.device("neuron")`), which needs the
unsharded fp32 model on one core: the dry run reports that out of memory at its line.
Run for real it needs the hardware (16 GB of bf16 weights alone); dry-run it with

    neuronlocal run --dry-run --instance trn2.48xlarge --nproc-per-node 64 \
        bench/dry_run_llama.py --layers 32

and it reports the peak HBM of rank 0 and rank 63 in bounded host memory (it prints its own
peak RSS). `--tp N` adds tensor parallelism over N consecutive ranks inside FSDP2 (a 2-D
mesh), as torchtitan lays out TP x FSDP. `--layers`, `--seq`, `--batch` and `--hidden`
shrink it for a real run.
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
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv * self.hd, bias=False)
        self.v = nn.Linear(d, kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q = self.q(h).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, -1, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv: int, ffn: int,
                 ac: bool = False) -> None:
        super().__init__()
        self.ac = ac
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, kv, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ac else layer(x)
        return self.head(self.norm(x))


def meshes(tp: int) -> tuple[Any, Any]:
    """The 2-D mesh (data parallel x tensor parallel, tp consecutive ranks per group) as
    its FSDP2 and its TP dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world}")
    mesh = init_device_mesh("neuron", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def shard_tensors(model: Llama, mesh: Any) -> None:
    """Megatron-style TP as torchtitan applies it: attention and FFN inputs column-wise,
    their outputs row-wise (one all-reduce each), the embedding row-wise and the output
    projection column-wise, gathered to whole logits for the loss."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    for layer in model.layers:
        if layer.kv % tp or layer.heads % tp:
            raise SystemExit(f"--tp {tp} must divide the heads ({layer.heads}) and kv heads "
                             f"({layer.kv})")
        parallelize_module(layer, mesh, {
            "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
            "down": RowwiseParallel()})
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate())})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--init", choices=["meta", "device"], default="meta")
    p.add_argument("--ac", action="store_true", help="full activation checkpointing per layer")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree inside FSDP2 (a 2-D mesh world/tp x tp)")
    a = p.parse_args()
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("neuron")
    dp_mesh, tp_mesh = meshes(a.tp) if a.tp > 1 else (None, None)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("meta" if a.init == "meta" else "neuron"):
        model = Llama(a.vocab, a.hidden, a.layers, a.heads, a.kv, a.ffn, a.ac).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if tp_mesh is not None:
        shard_tensors(model, tp_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    if a.init == "meta":
        model.to_empty(device="neuron")
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), device="neuron")
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, a.vocab).float(), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"rank {dist.get_rank()} step {step}: loss {loss.item():.4f}, {n / 1e9:.2f}B "
              f"params, peak HBM {torch.neuron.max_memory_allocated() / 2**30:.2f} GiB, host "
              f"peak RSS {rss:.2f} GiB, {time.time() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
