"""Custom kernels on neuron: nki_op, the kernel library vs PyTorch references, HF kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuronlocal import kernels as K

pytestmark = pytest.mark.timeout(600)
DEV = "neuron"


# ------------------------------------------------------------------ references (PyTorch)

def ref_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def ref_rope(q, k, cos, sin, dim=1):
    c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
    return q * c + ref_rotate_half(q) * s, k * c + ref_rotate_half(k) * s


def ref_attention(q, k, v, mask=None, scale=None, is_causal=False):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)


def leaves(*ts, device=DEV):
    """The same random values as CPU leaves and as neuron leaves (both requiring grad)."""
    cpu = [t.clone().requires_grad_(t.is_floating_point()) for t in ts]
    dev = [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in ts]
    return cpu, dev


def check_fwd_bwd(ref, ker, inputs, atol=1e-4, rtol=1e-4, grads=None):
    cpu, dev = leaves(*inputs)
    out_ref, out_dev = ref(*cpu), ker(*dev)
    out_ref = out_ref if isinstance(out_ref, tuple) else (out_ref,)
    out_dev = out_dev if isinstance(out_dev, tuple) else (out_dev,)
    for a, b in zip(out_ref, out_dev, strict=True):
        assert b.device.type == "neuron"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=atol, rtol=rtol)
    torch.manual_seed(1)
    cots = [torch.randn_like(a) for a in out_ref]
    torch.autograd.backward(out_ref, cots)
    torch.autograd.backward(out_dev, [c.to(DEV) for c in cots])
    for i, (a, b) in enumerate(zip(cpu, dev, strict=True)):
        if grads is not None and i not in grads:
            continue
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, atol=atol * 10, rtol=rtol * 10)


# ------------------------------------------------------------------ kernel library

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_rms_norm(dtype, tol):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    check_fwd_bwd(lambda a, b: ref_rms(a, b, 1e-6), lambda a, b: K.rms_norm(a, b, 1e-6),
                  [x, w], atol=tol, rtol=tol)


def test_silu_and_mul():
    torch.manual_seed(0)
    g, u = torch.randn(3, 7, 48), torch.randn(3, 7, 48)
    check_fwd_bwd(lambda a, b: F.silu(a) * b, K.silu_and_mul, [g, u])
    packed = torch.randn(4, 32)
    torch.testing.assert_close(K.silu_and_mul(packed.to(DEV)).cpu(),
                               F.silu(packed[:, :16]) * packed[:, 16:])


@pytest.mark.parametrize("dim", [1, 2])
def test_rotary(dim):
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 6, 16
    shape = (b, h, s, d) if dim == 1 else (b, s, h, d)
    kshape = (b, hk, s, d) if dim == 1 else (b, s, hk, d)
    q, k = torch.randn(shape), torch.randn(kshape)
    cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)   # general (halves not equal)
    check_fwd_bwd(lambda *a: ref_rope(*a, dim), lambda *a: K.apply_rotary(*a, dim),
                  [q, k, cos, sin], grads={0, 1})


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "mha"])
def test_attention(case):
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2 if case != "mha" else 4, 8, 16
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    mask, causal = None, case in ("causal", "mha")
    if case == "bool_mask":
        mask = torch.rand(b, 1, s, s) > 0.3
        mask[..., 0] = True
    elif case == "float_mask":
        mask = torch.randn(b, 1, s, s)
    check_fwd_bwd(lambda q_, k_, v_: ref_attention(q_, k_, v_, mask, is_causal=causal),
                  lambda q_, k_, v_: K.attention(q_, k_, v_, None if mask is None
                                                 else mask.to(DEV), is_causal=causal),
                  [q, k, v])


def test_cached_attention_prefill_then_decode():
    torch.manual_seed(0)
    b, h, hk, d, max_len, prompt = 2, 4, 2, 16, 12, 5
    kc = torch.zeros(b, hk, max_len, d, device=DEV)
    vc = torch.zeros(b, hk, max_len, d, device=DEV)
    ks, vs, qs = (torch.randn(b, hk, prompt + 3, d), torch.randn(b, hk, prompt + 3, d),
                  torch.randn(b, h, prompt + 3, d))
    # prefill the prompt, then decode three tokens one by one
    steps = [(0, prompt)] + [(p, p + 1) for p in range(prompt, prompt + 3)]
    for lo, hi in steps:
        pos = torch.arange(lo, hi)
        out = K.cached_attention(qs[:, :, lo:hi].to(DEV), ks[:, :, lo:hi].to(DEV),
                                 vs[:, :, lo:hi].to(DEV), kc, vc, pos.to(DEV))
        mask = torch.arange(hi)[None, :] <= pos[:, None]
        ref = ref_attention(qs[:, :, lo:hi], ks[:, :, :hi], vs[:, :, :hi], mask)
        torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[:, :, :prompt + 3].cpu(), ks)
    assert kc[:, :, prompt + 3:].abs().sum().item() == 0


def test_bad_input_errors_name_the_fix():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight shape .* 1-D weight of size"):
        K.rms_norm(x, torch.ones(4, device=DEV))
    with pytest.raises(ValueError, match="key/value heads that divide"):
        q = torch.randn(1, 3, 4, 8, device=DEV)
        K.attention(q, torch.randn(1, 2, 4, 8, device=DEV), torch.randn(1, 2, 4, 8, device=DEV))
    with pytest.raises(ValueError, match="namespace::op_name"):
        K.nki_op("no_namespace")
