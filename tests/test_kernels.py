"""Custom kernels on neuron: nki_op, the kernel library vs PyTorch references, HF kernels."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from neuronlocal import kernels as K
from neuronlocal.kernels import hub

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


# ------------------------------------------------------------------ nki_op

@K.nki_op("test_kernels::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@K.nki_op("test_kernels::add_into", mutates_args={"out"})
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


def _sa_setup(ctx, inputs, output):
    ctx.alpha = inputs[2]


scaled_add.register_autograd(lambda ctx, g: (g, g * ctx.alpha, None), setup_context=_sa_setup)


def test_nki_op_eager_autograd_and_mutation():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    check_fwd_bwd(lambda a, b: a + 2.5 * b, lambda a, b: scaled_add(a, b, 2.5), [x, y])
    out = torch.zeros(3, 4, device=DEV)
    add_into(x.to(DEV), out)
    torch.testing.assert_close(out.cpu(), x)
    # fake implementation: shape/dtype inference without data
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        f = scaled_add(torch.empty(5, 2, device=DEV), torch.empty(5, 2, device=DEV), 1.0)
    assert f.shape == (5, 2) and f.device.type == "neuron"


def test_torch_neuronx_exposes_nki_op():
    import torch_neuronx

    assert torch_neuronx.nki_op is K.nki_op
    launcher = torch_neuronx.wrap_nki(lambda a: a * 2)[(1,)]
    torch.testing.assert_close(launcher(torch.ones(2, device=DEV)).cpu(), torch.full((2,), 2.0))


def test_nki_op_is_one_node_under_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neff"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "locks"))
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        from neuronlocal.compile.backend import neuron_backend
        return neuron_backend(gm, example_inputs)

    def f(x, w, g, u):
        return K.rms_norm(x, w) + K.silu_and_mul(g, u).sum(-1, keepdim=True)

    args = [torch.randn(2, 8, 16), torch.randn(16), torch.randn(2, 8, 4), torch.randn(2, 8, 4)]
    ref = f(*[a.to(DEV) for a in args]).cpu()
    try:
        out = torch.compile(f, backend=counting, fullgraph=True)(*[a.to(DEV) for a in args])
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out.cpu(), ref)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("neuronlocal.rms_norm.default") == 1
    assert targets.count("neuronlocal.silu_and_mul.default") == 1


# ------------------------------------------------------------------ HF kernels mapping

def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_kernelize_swaps_llama_layers_locally():
    pytest.importorskip("kernels", reason="HF `kernels` not installed (requirements-dev.txt)")
    import copy

    cpu = _tiny_llama()
    ids = torch.randint(0, 100, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[0, :3] = 0                      # left padding: exercises the attention mask path
    with torch.no_grad():
        ref = cpu(ids, attention_mask=am).logits
    model = copy.deepcopy(cpu).to(DEV)
    K.kernelize(model, device="neuron")
    layer = model.model.layers[0]
    assert type(layer.input_layernorm.forward.__self__) is type(layer.input_layernorm)
    assert layer.input_layernorm.forward.__func__.__qualname__ == "RMSNorm.forward"
    assert layer.mlp.forward.__func__.__qualname__ == "SwiGLUMLP.forward"
    from transformers.models.llama import modeling_llama as ml

    rot = layer.self_attn._kernel_funcs[hub.func_key(ml.apply_rotary_pos_emb)]
    assert rot.forward.__func__.__qualname__ == "RotaryEmbedding.forward"
    assert model.config._attn_implementation == "neuron"
    with torch.no_grad():
        out = model(ids.to(DEV), attention_mask=am.to(DEV)).logits.cpu()
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0, 3:], ref[0, 3:], atol=1e-4, rtol=1e-4)
    # training mode: gradients through the kernels match plain PyTorch on CPU
    model.train()
    cpu.train()
    K.kernelize(model)
    model(ids.to(DEV), labels=ids.to(DEV)).loss.backward()
    cpu(ids, labels=ids).loss.backward()
    for (name, a), b in zip(cpu.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_kernels_library_api_with_local_repository():
    kernels = pytest.importorskip("kernels", reason="HF `kernels` not installed")
    mapping = K.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "rotary_pos_emb", "LlamaMLP"}
    layer = mapping["RMSNorm"]["neuron"].load()
    assert layer.__name__ == "RMSNorm" and layer.__module__ == "neuronlocal.kernels.layers"
    model = _tiny_llama().to(DEV)
    K.register()
    kernels.kernelize(model, device="neuron", mode=kernels.Mode.INFERENCE)
    assert model.model.norm.forward.__func__.__qualname__ == "RMSNorm.forward"
    with pytest.raises(ValueError, match="device 'neuron'"):
        K.kernelize(model, device="cuda")


def test_transformers_use_kernels_with_kernel_config(tmp_path):
    pytest.importorskip("kernels", reason="HF `kernels` not installed")
    from transformers.utils.import_utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("transformers' pinned `kernels` range is not installed (transformers 5.24 "
                    "wants kernels>=0.18.2; the newest on this index is 0.17.2), so "
                    "transformers disables use_kernels")
    import transformers

    _tiny_llama().save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, use_kernels=True, kernel_config=K.kernel_config(), device_map="neuron",
        attn_implementation="neuron")
    assert model.model.norm.forward.__func__.__qualname__ == "RMSNorm.forward"


STOCK_KERNELIZE = """
import json, torch, transformers, kernels
cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
cpu = transformers.LlamaForCausalLM(cfg).eval()
model = transformers.LlamaForCausalLM(cfg).eval()
model.load_state_dict(cpu.state_dict())
model = kernels.kernelize(model.to("neuron"), device="neuron", mode=kernels.Mode.INFERENCE)
ids = torch.randint(0, 100, (1, 9))
with torch.no_grad():
    diff = (model(ids.to("neuron")).logits.cpu() - cpu(ids).logits).abs().max().item()
print(json.dumps({"norm": model.model.norm.forward.__func__.__qualname__,
                  "mlp": model.model.layers[0].mlp.forward.__func__.__qualname__,
                  "diff": diff}))
"""


def test_stock_kernelize_on_neuron_swaps_layers(fresh_python):
    """The HF `kernels` call a user writes, with nothing from neuronlocal imported: the
    model's layers run neuronlocal's kernels and the logits match CPU."""
    pytest.importorskip("kernels", reason="HF `kernels` not installed")
    r = fresh_python(STOCK_KERNELIZE, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert (out["norm"], out["mlp"]) == ("RMSNorm.forward", "SwiGLUMLP.forward")
    assert out["diff"] < 1e-4


def test_stock_kernelize_that_swaps_nothing_says_so():
    kernels = pytest.importorskip("kernels", reason="HF `kernels` not installed")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(DEV)
    with pytest.warns(UserWarning, match=r"swapped no layer of Sequential.*runs its own layers"):
        kernels.kernelize(model, device="neuron", mode=kernels.Mode.INFERENCE)


# ------------------------------------------------------------------ kernels are device ops

def test_library_kernels_and_nki_ops_are_device_ops_not_fallbacks():
    """An NKI kernel runs on the NeuronCore: executed, never a CPU fallback, never warned."""
    import warnings

    import torch_neuronx
    from neuronlocal.eager import ops

    @K.nki_op("fidelitytest::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(4, 8).to(DEV)
    w = torch.ones(8).to(DEV)
    torch_neuronx.clear_op_tracking()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        K.rms_norm(x, w)
        K.silu_and_mul(x, x)
        double(x)
    assert not [str(c.message) for c in caught if "fallback" in str(c.message)]
    assert torch_neuronx.get_fallback_ops() == {}
    executed = torch_neuronx.get_executed_ops()
    for name in ("neuronlocal::rms_norm", "neuronlocal::silu_and_mul", "fidelitytest::double"):
        assert name in executed
        p = ops.placement(name)
        assert (p.placement, p.runs) == ("device", "device")
        assert "NKI kernel" in p.evidence()


def test_missing_digest_warning_once_per_process_with_its_meaning(caplog):
    pytest.importorskip("kernels")
    import logging

    hub.register()
    hub.DIGEST_FILTER.seen = False
    log = logging.getLogger("kernels._internals.validate")
    msg = ("Kernel 'x' variant 'y': the metadata does not record a digest, so its integrity "
           "cannot be verified")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            log.warning(msg)
    shown = [r.getMessage() for r in caplog.records if "digest" in r.getMessage()]
    assert len(shown) == 1 and "unverified" in shown[0] and "once per process" in shown[0]


def test_kernelize_records_swapped_layers_and_kernel_ops_for_the_report(monkeypatch, tmp_path):
    """transformers' own switch decides (use_kernels defaults on, USE_HUB_KERNELS=NO turns it
    off); the report lists the layers swapped and the kernel ops as device ops."""
    pytest.importorskip("kernels", reason="HF `kernels` not installed")
    import transformers

    import torch_neuronx
    from neuronlocal.core import counters
    from neuronlocal.report import collect, render

    _tiny_llama().save_pretrained(tmp_path)
    counters.reset()
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    off = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="neuron")
    assert counters.get_kernel_swaps() == []
    assert off.model.norm.forward.__func__.__qualname__ == "LlamaRMSNorm.forward"
    monkeypatch.delenv("USE_HUB_KERNELS")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="neuron")
    swaps = {s["layer"]: s["modules"] for s in counters.get_kernel_swaps()}
    assert swaps.get("LlamaRMSNorm") == 5 and swaps.get("LlamaMLP") == 2
    torch_neuronx.clear_op_tracking()
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 6)).to(DEV))
    ops = collect.kernel_ops()
    assert ops.get("neuronlocal::rms_norm") == 5 and "neuronlocal::silu_and_mul" in ops
    assert not any(op.startswith("neuronlocal::") for op in torch_neuronx.get_fallback_ops())
    rank = {"rank": 0, "kernel_swaps": counters.get_kernel_swaps(), "kernel_ops": ops}
    rep = {"ranks": [dict.fromkeys(("graphs", "recompiles", "bucket_suggestions",
                                    "graph_breaks", "fallback_ops", "memory",
                                    "collectives"), []) | {"downcast_ops": {}} | rank]}
    titles = {s.title: s.rows for s in render.sections(rep)}
    assert ["LlamaForCausalLM", "LlamaRMSNorm", 5] in titles[
        "Kernel layers swapped in (kernels.kernelize)"]
    assert ["neuronlocal::rms_norm", 5] in titles[
        "Kernel ops (NKI kernels: run on the NeuronCore)"]
    counters.reset()
