"""The kernel library on neuron: kernel / PyTorch reference, each side in its own process.

On the host a kernel must be correct and never slower than the PyTorch code it replaces:
(a) each kernel vs its reference on neuron tensors (shapes of the model in (b)): speed-up
    goal >= 1.0
(b) eager forward of Llama (hidden 1024, 8 layers, batch 4x256) on neuron, kernelized
    (`neuronlocal.kernels.kernelize`) / plain: speed-up goal >= 1.0
Outputs are checked against the references once, in the parent process.
Run: python bench/kernel_library.py [--quick] [--rounds N]   (--quick: hidden 256, 2 layers, 2x64)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _common import Case, Goal, llama, run_cases

SIDES = ("reference", "kernel")


def _shapes(quick: bool) -> dict[str, int]:
    return ({"hidden": 256, "layers": 2, "batch": 2, "seq": 64} if quick else
            {"hidden": 1024, "layers": 8, "batch": 4, "seq": 256})


def _inputs(hidden: int, batch: int, seq: int) -> dict[str, Any]:
    import torch

    d, heads, kv, hd = "neuron", hidden // 64, hidden // 128, 64
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(d)

    t = {"x": r(batch, seq, hidden), "w": r(hidden), "g": r(batch, seq, 2 * hidden),
         "u": r(batch, seq, 2 * hidden), "q": r(batch, heads, seq, hd), "k": r(batch, kv, seq, hd),
         "v": r(batch, kv, seq, hd), "cos": r(batch, seq, hd), "sin": r(batch, seq, hd),
         "kc": torch.zeros(batch, kv, seq, hd, device=d),
         "vc": torch.zeros(batch, kv, seq, hd, device=d), "heads": heads, "kv": kv}
    t["pos"] = torch.tensor([seq // 2], device=d)  # decode in the middle of the cache
    t["q1"], t["k1"], t["v1"] = (t[n][:, :, :1].contiguous() for n in ("q", "k", "v"))
    return t


def _rotate_half(x: Any) -> Any:
    import torch

    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _pairs(t: dict[str, Any]) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """name -> (reference, kernel): the reference is what transformers' Llama runs."""
    import torch
    import torch.nn.functional as F

    import neuronlocal.kernels as K

    x, w, g, u, q, k, v = (t[n] for n in ("x", "w", "g", "u", "q", "k", "v"))
    heads, kv, kc, vc, pos = t["heads"], t["kv"], t["kc"], t["vc"], t["pos"]

    def rms_ref() -> Any:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def rope_ref() -> Any:
        c, s = t["cos"].unsqueeze(1), t["sin"].unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def attn_ref() -> Any:
        kk, vv = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    def decode_ref() -> Any:  # HF static cache: index_copy_, repeat_kv, mask of seen slots
        kc.index_copy_(2, pos, t["k1"])
        vc.index_copy_(2, pos, t["v1"])
        kk, vv = kc.repeat_interleave(heads // kv, 1), vc.repeat_interleave(heads // kv, 1)
        mask = torch.arange(kc.shape[2], device=kc.device)[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(t["q1"], kk, vv, attn_mask=mask)

    return {
        "rms_norm": (rms_ref, lambda: K.rms_norm(x, w, 1e-6)),
        "silu_and_mul": (lambda: F.silu(g) * u, lambda: K.silu_and_mul(g, u)),
        "rotary (q and k)": (rope_ref, lambda: K.apply_rotary(q, k, t["cos"], t["sin"])),
        "attention prefill (causal, GQA)": (attn_ref,
                                            lambda: K.attention(q, k, v, is_causal=True)),
        "attention decode (static cache)": (
            decode_ref, lambda: K.cached_attention(t["q1"], t["k1"], t["v1"], kc, vc, pos)),
    }


def kernel_setup(side: str, name: str, hidden: int, batch: int, seq: int, **_: int
                 ) -> Callable[[], object]:
    import torch

    ref, ker = _pairs(_inputs(hidden, batch, seq))[name]
    fn = ref if side == "reference" else ker

    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def model_setup(side: str, hidden: int, layers: int, batch: int, seq: int
                ) -> Callable[[], object]:
    import torch

    import neuronlocal.kernels as K

    model = llama(hidden, layers).to("neuron")
    if side == "kernel":
        model = K.kernelize(model)
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to("neuron")

    def run() -> object:
        with torch.no_grad():
            return model(ids).logits

    return run


KERNELS = ("rms_norm", "silu_and_mul", "rotary (q and k)", "attention prefill (causal, GQA)",
           "attention decode (static cache)")


def cases(quick: bool) -> list[Case]:
    s = _shapes(quick)
    out = [Case(name, kernel_setup, {"name": name, **s}, Goal(">=", 1.0), SIDES, speedup=True)
           for name in KERNELS]
    label = f"Llama fwd h{s['hidden']} L{s['layers']} {s['batch']}x{s['seq']}, kernelized"
    out.append(Case(label, model_setup, s, Goal(">=", 1.0), SIDES, speedup=True))
    return out


def check(args: Any) -> dict[str, Any]:
    """Each kernel and the kernelized model against its reference (once, here)."""
    import copy

    import torch

    import neuronlocal.kernels as K

    s = _shapes(args.quick)
    with torch.no_grad():
        for name, (ref, ker) in _pairs(_inputs(s["hidden"], s["batch"], s["seq"])).items():
            torch.testing.assert_close(ker(), ref(), atol=1e-4, rtol=1e-4, msg=name)
        plain = llama(s["hidden"], s["layers"]).to("neuron")
        fast = K.kernelize(copy.deepcopy(plain))
        ids = torch.randint(0, 1000, (s["batch"], s["seq"])).to("neuron")
        torch.testing.assert_close(fast(ids).logits.cpu(), plain(ids).logits.cpu(),
                                   atol=1e-3, rtol=1e-3)
    print("outputs match the references")
    return {"outputs_match": True}


if __name__ == "__main__":
    run_cases(__file__, cases, title="kernels: reference / kernel (speed-up)",
              description=__doc__, extra=check)
