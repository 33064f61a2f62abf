"""Custom kernels on neuron (issue 8): kernelized / plain, measured in the same run.

(a) eager forward of Llama (hidden 1024, 8 layers, batch 4x256) on neuron, with the
    neuronlocal kernels (kernelize) / without: goal >= 1.3x faster
(b) each kernel vs its PyTorch reference on neuron tensors (same shapes as in (a))
Run: python bench/kernels.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _common import best_of, llama  # noqa: E402

# This file is named kernels.py: keep its folder off sys.path so `import kernels` is HF's.
sys.path[:] = [p for p in sys.path if p not in (_HERE, "bench") and Path(p or ".").resolve()
               != Path(_HERE)]

import neuronlocal.kernels as K  # noqa: E402


def model_ratio(hidden: int, layers: int, batch: int, seq: int, repeat: int) -> tuple[float, float]:
    plain = llama(hidden, layers).to("neuron")
    fast = K.kernelize(copy.deepcopy(plain))
    ids = torch.randint(0, 1000, (batch, seq)).to("neuron")
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits.cpu(), plain(ids).logits.cpu(),
                                   atol=1e-3, rtol=1e-3)
        t_plain = best_of(lambda: plain(ids).logits, repeat, 1)
        t_fast = best_of(lambda: fast(ids).logits, repeat, 1)
    return t_plain, t_fast


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def kernel_rows(batch: int, seq: int, hidden: int, repeat: int) -> list[tuple[str, float, float]]:
    d = "neuron"
    heads, kv, hd = hidden // 64, hidden // 128, 64
    x, w = torch.randn(batch, seq, hidden, device=d), torch.randn(hidden, device=d)
    g, u = torch.randn(batch, seq, 2 * hidden, device=d), torch.randn(batch, seq, 2 * hidden,
                                                                      device=d)
    q, k = torch.randn(batch, heads, seq, hd, device=d), torch.randn(batch, kv, seq, hd, device=d)
    v = torch.randn(batch, kv, seq, hd, device=d)
    cos, sin = torch.randn(batch, seq, hd, device=d), torch.randn(batch, seq, hd, device=d)

    def rms_ref() -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rope_ref() -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def attn_ref() -> torch.Tensor:
        kk, vv = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    kc = torch.zeros(batch, kv, seq, hd, device=d)
    vc = torch.zeros(batch, kv, seq, hd, device=d)
    pos = torch.tensor([seq - 1], device=d)
    q1, k1, v1 = q[:, :, -1:].contiguous(), k[:, :, -1:].contiguous(), v[:, :, -1:].contiguous()

    def decode_ref() -> torch.Tensor:
        kc.index_copy_(2, pos, k1)
        vc.index_copy_(2, pos, v1)
        kk, vv = kc.repeat_interleave(heads // kv, 1), vc.repeat_interleave(heads // kv, 1)
        return F.scaled_dot_product_attention(q1, kk, vv)

    cases = [
        ("rms_norm", rms_ref, lambda: K.rms_norm(x, w, 1e-6)),
        ("silu_and_mul", lambda: F.silu(g) * u, lambda: K.silu_and_mul(g, u)),
        ("rotary (q and k)", rope_ref, lambda: K.apply_rotary(q, k, cos, sin)),
        ("attention prefill (causal, GQA)", attn_ref, lambda: K.attention(q, k, v, is_causal=True)),
        ("attention decode (static cache)", decode_ref,
         lambda: K.cached_attention(q1, k1, v1, kc, vc, pos)),
    ]
    rows = []
    with torch.no_grad():
        for name, ref, ker in cases:
            rows.append((name, best_of(ref, repeat), best_of(ker, repeat)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="small model (hidden 256, 2 layers)")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    hidden, layers, batch, seq = (256, 2, 2, 64) if args.quick else (1024, 8, 4, 256)
    print(f"{'case':42s} {'plain ms':>10s} {'kernels ms':>10s} {'speedup':>8s}")
    for name, t_ref, t_ker in kernel_rows(batch, seq, hidden, args.repeat):
        print(f"{name:42s} {t_ref * 1e3:10.2f} {t_ker * 1e3:10.2f} {t_ref / t_ker:7.2f}x")
    t_plain, t_fast = model_ratio(hidden, layers, batch, seq, args.repeat)
    label = f"Llama fwd h{hidden} L{layers} {batch}x{seq} (goal >=1.3x)"
    print(f"{label:42s} {t_plain * 1e3:10.2f} {t_fast * 1e3:10.2f} {t_plain / t_fast:7.2f}x")


if __name__ == "__main__":
    main()
