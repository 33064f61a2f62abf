"""The demo job: a small transformer trained one step on neuron and on CPU, compared.

It shows what the backend is for in ten seconds: same numbers as CPU, plus what the run
would cost on Trainium (ops that fall back to the host, 64-bit downcasts, HBM per core).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from neuronlocal import device as neuron


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


@dataclass
class DemoResult:
    loss_cpu: float
    loss_neuron: float
    max_logit_diff: float
    max_grad_diff: float
    ms_cpu: float
    ms_neuron: float
    peak_hbm: int


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return logits, loss


def run(steps: int = 3, seed: int = 0) -> DemoResult:
    torch.manual_seed(seed)
    cpu = TinyLM()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 512, (4, 65))
    neuron.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        cpu.zero_grad()
        logits_c, loss_c = _step(cpu, ids)
    t1 = time.perf_counter()
    for _ in range(steps):
        dev.zero_grad()
        logits_n, loss_n = _step(dev, ids.to("neuron"))
    t2 = time.perf_counter()
    grad_diff = max((a.grad - b.grad.cpu()).abs().max().item()
                    for a, b in zip(cpu.parameters(), dev.parameters(), strict=True)
                    if a.grad is not None and b.grad is not None)
    return DemoResult(loss_c.item(), loss_n.item(), (logits_c - logits_n.cpu()).abs().max().item(),
                      grad_diff, (t1 - t0) / steps * 1e3, (t2 - t1) / steps * 1e3,
                      neuron.max_memory_allocated())
