"""The kernel library: RMSNorm, SiLU-and-mul, rotary embedding, attention (and with a cache).

Each kernel is an `nki_op` whose body does its whole computation in one host call with the
fewest passes over memory ATen offers (fused `torch.rms_norm`, in-place epilogues, `out=`
into halves, one `scaled_dot_product_attention`), so on neuron it costs one dispatch instead
of one per intermediate op. Backward passes are nki_ops too (closed-form gradients), attached
with `register_autograd`. The PyTorch reference of each kernel lives in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuronlocal.kernels.api import nki_op

__all__ = ["apply_rotary", "attention", "cached_attention", "rms_norm", "silu_and_mul"]


def _fail(kernel: str, problem: str, fix: str) -> None:
    raise ValueError(f"neuronlocal.kernels.{kernel}: {problem}; {fix}.")


# ---------------------------------------------------------------- RMSNorm

@nki_op("neuronlocal::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch.rms_norm is a composite on CPU (pow, mean, add, rsqrt, mul, mul: 4 full-size
    # temporaries); a norm reduction plus two passes over x allocate one.
    n = x.shape[-1]
    xf = x.float()
    r = torch.linalg.vector_norm(xf, 2, -1, keepdim=True).square_().div_(n).add_(eps).rsqrt_()
    y = xf * r
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return y.mul_(weight)
    # As HF's LlamaRMSNorm: normalise in float32, cast back, then scale.
    return weight * y.to(x.dtype)


@nki_op("neuronlocal::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    xhat = xf.mul_(r) if xf is not x else xf * r
    gw = grad.float() * weight.float()
    dx = gw.sub_(xhat * (gw * xhat).mean(-1, keepdim=True)).mul_(r)
    dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = _rms_norm_backward(grad, x, weight, ctx.eps)
    return dx, dw, None


_rms_norm.register_autograd(_rms_bwd, setup_context=_rms_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps), normalised in float32 (HF Llama's RMSNorm)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        _fail("rms_norm", f"weight shape {tuple(weight.shape)} does not match the last dim of "
              f"x {tuple(x.shape)}", "pass a 1-D weight of size x.shape[-1]")
    return _rms_norm(x, weight, float(eps))


# ---------------------------------------------------------------- SiLU-and-mul (SwiGLU)

@nki_op("neuronlocal::silu_and_mul", mutates_args=())
def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).mul_(up)


@nki_op("neuronlocal::silu_and_mul_backward", mutates_args=())
def _silu_and_mul_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(gate)
    d_up = gate * s
    d_up.mul_(grad)
    # d silu(g)/dg = s * (1 + g * (1 - s))
    d_gate = (1 - s).mul_(gate).add_(1).mul_(s).mul_(up).mul_(grad)
    return d_gate, d_up


def _sm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _sm_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    return _silu_and_mul_backward(grad, gate, up)


_silu_and_mul.register_autograd(_sm_bwd, setup_context=_sm_setup)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; with one argument, its last dim is split in halves [gate, up]."""
    if up is None:
        if gate.shape[-1] % 2:
            _fail("silu_and_mul", f"last dim {gate.shape[-1]} of the packed input is odd",
                  "pack [gate, up] along the last dim or pass them separately")
        gate, up = gate.chunk(2, dim=-1)
    if gate.shape != up.shape:
        _fail("silu_and_mul", f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ",
              "pass tensors of the same shape")
    return _silu_and_mul(gate, up)


# ---------------------------------------------------------------- rotary embedding

def _signed_sin(s: torch.Tensor, sign: int) -> torch.Tensor:
    """[-s1, s2] (sign=1) or [s2, -s1] (sign=-1): rotate_half's signs folded into sin."""
    h = s.shape[-1] // 2
    s1, s2 = s[..., :h], s[..., h:]
    return torch.cat((-s1, s2) if sign > 0 else (s2, -s1), dim=-1)


def _rope(x: torch.Tensor, c: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
    """x*c + roll(x, half)*ss: with ss from _signed_sin, x*c + rotate_half(x)*s (sign=1) or
    its transpose (sign=-1). Three contiguous passes; the sign fold is on sin, which is not
    repeated per head."""
    return torch.mul(x, c).addcmul_(x.roll(x.shape[-1] // 2, -1), ss)


@nki_op("neuronlocal::rotary_embedding", mutates_args=())
def _rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    c, ss = cos.unsqueeze(unsqueeze_dim), _signed_sin(sin, 1).unsqueeze(unsqueeze_dim)
    return _rope(q, c, ss), _rope(k, c, ss)


@nki_op("neuronlocal::rotary_embedding_backward", mutates_args=())
def _rotary_backward(
    gq: torch.Tensor, gk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    c, ss = cos.unsqueeze(unsqueeze_dim), _signed_sin(sin, -1).unsqueeze(unsqueeze_dim)
    return _rope(gq, c, ss), _rope(gk, c, ss)


def _rot_setup(ctx, inputs, output):
    q, k, cos, sin, dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dim, ctx.shapes = dim, (q.shape, k.shape, q.dtype, k.dtype)


def _rot_bwd(ctx, gq, gk):
    cos, sin = ctx.saved_tensors
    qs, ks, qd, kd = ctx.shapes
    gq = torch.zeros(qs, dtype=qd, device=cos.device) if gq is None else gq
    gk = torch.zeros(ks, dtype=kd, device=cos.device) if gk is None else gk
    dq, dk = _rotary_backward(gq, gk, cos, sin, ctx.dim)
    # cos/sin come from fixed frequencies: no gradient flows into them.
    return dq.sum_to_size(qs).to(qd), dk.sum_to_size(ks).to(kd), None, None, None


_rotary.register_autograd(_rot_bwd, setup_context=_rot_setup)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q*cos + rotate_half(q)*sin, same for k), HF's apply_rotary_pos_emb."""
    if q.shape[-1] % 2 or q.shape[-1] != cos.shape[-1] or cos.shape != sin.shape:
        _fail("apply_rotary", f"head dim of q {tuple(q.shape)} must be even and equal to the "
              f"last dim of cos {tuple(cos.shape)} and sin {tuple(sin.shape)}",
              "pass cos/sin of shape (batch, seq, head_dim)")
    return _rotary(q, k, cos, sin, int(unsqueeze_dim))


# ---------------------------------------------------------------- attention

def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores_mask(
    s: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    if is_causal:
        lq, lk = s.shape[-2], s.shape[-1]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril_(lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


@nki_op("neuronlocal::attention", mutates_args=())
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scale: float, is_causal: bool,
) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    if gqa and mask is not None:   # CPU flash attention takes GQA only without a mask
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


@nki_op("neuronlocal::attention_backward", mutates_args=())
def _attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None, scale: float, is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, gf = q.float(), grad.float()
    kf, vf = _expand_kv(k.float(), heads), _expand_kv(v.float(), heads)
    p = torch.softmax(_scores_mask(qf @ kf.transpose(-1, -2) * scale, mask, is_causal), -1)
    dv = p.transpose(-1, -2) @ gf
    dp = gf @ vf.transpose(-1, -2)
    ds = p.mul_(dp.sub_((dp * p).sum(-1, keepdim=True))).mul_(scale)
    dq = ds @ kf
    dk = ds.transpose(-1, -2) @ qf
    if kv_heads != heads:
        b, _, lk, d = dk.shape
        dk = dk.view(b, kv_heads, heads // kv_heads, lk, d).sum(2)
        dv = dv.view(b, kv_heads, heads // kv_heads, lk, dv.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _attn_setup(ctx, inputs, output):
    q, k, v, mask, scale, is_causal = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.scale, ctx.is_causal = scale, is_causal


def _attn_bwd(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = _attention_backward(grad, q, k, v, mask, ctx.scale, ctx.is_causal)
    return dq, dk, dv, None, None, None


_attention.register_autograd(_attn_bwd, setup_context=_attn_setup)


def _check_qkv(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        _fail(kernel, f"q, k, v must be 4-D, got {q.dim()}, {k.dim()}, {v.dim()} dims",
              "use the (batch, heads, seq, head_dim) layout")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        _fail(kernel, f"{q.shape[1]} query heads and {k.shape[1]}/{v.shape[1]} key/value heads",
              "use key/value heads that divide the query heads (GQA)")


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
    scale: float | None = None, is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over (batch, heads, seq, head_dim); GQA allowed."""
    _check_qkv("attention", q, k, v)
    if is_causal and mask is not None:
        _fail("attention", "is_causal=True and a mask were both given",
              "fold the causal part into the mask or drop the mask")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attention(q, k, v, mask, scale, bool(is_causal))


@nki_op("neuronlocal::cached_attention", mutates_args={"k_cache", "v_cache"})
def _cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, cache_position: torch.Tensor, scale: float,
) -> torch.Tensor:
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    pos = cache_position.tolist()
    lq, heads = len(pos), q.shape[1]
    if pos == list(range(pos[0], pos[0] + lq)):
        # Consecutive positions (prefill, decode): only slots up to the last are read, so
        # slice them instead of masking the whole cache, and let SDPA expand GQA heads
        # instead of copying the cache per query head.
        end = pos[0] + lq
        kc, vc = k_cache[:, :, :end], v_cache[:, :, :end]
        if lq == 1 or pos[0] == 0:   # one query sees every slot; or a square causal block
            return F.scaled_dot_product_attention(q, kc, vc, is_causal=lq > 1, scale=scale,
                                                  enable_gqa=kc.shape[1] != heads)
        keys = torch.arange(end, device=q.device)
    else:
        kc, vc = k_cache, v_cache
        keys = torch.arange(k_cache.shape[2], device=q.device)
    mask = keys[None, :] <= cache_position[:, None]    # query i sees cache slots <= its pos
    kc, vc = _expand_kv(kc, heads), _expand_kv(vc, heads)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale)


@_cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, cache_position, scale):
    # The body reads cache_position's values, which tracing tensors do not have.
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1]))


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, cache_position: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """Prefill or decode step on a static KV cache (inference).

    Writes k, v into the caches (batch, kv_heads, max_len, head_dim) at `cache_position`
    (the positions of the q tokens), then attends causally by position over the cache.
    """
    _check_qkv("cached_attention", q, k_cache, v_cache)
    if cache_position.dim() != 1 or cache_position.numel() != q.shape[2]:
        _fail("cached_attention", f"cache_position has shape {tuple(cache_position.shape)} for "
              f"{q.shape[2]} query tokens", "pass one position per query token")
    if k.shape[2] != q.shape[2] or k.shape[1] != k_cache.shape[1]:
        _fail("cached_attention", f"new keys {tuple(k.shape)} do not fit q {tuple(q.shape)} "
              f"and cache {tuple(k_cache.shape)}", "pass k, v for the same tokens as q")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _cached_attention(q, k, v, k_cache, v_cache, cache_position, scale)
