"""The Trainium cost estimator: FLOP counts against closed forms, calibration against the
published rows it was fitted and tested on, the `neuronlocal estimate` CLI, and the
estimates the run report and `check` attach to compiled graphs and training steps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx

from neuronlocal import cli, estimate
from neuronlocal.core.hardware import TRAINIUM1, TRAINIUM2, TRAINIUM3, GiB
from neuronlocal.estimate import (
    calibrate,
    capture,
    fitted,
    presets,
    published,
    rates,
    workload,
)
from neuronlocal.estimate.counting import Counter
from neuronlocal.estimate.layout import Layout, problems
from neuronlocal.estimate.roofline import Factors

SPEC = rates.instance("trn2.48xlarge")


def _cost(fn, *inputs):
    return estimate.graph_cost(fx.symbolic_trace(fn), list(inputs), SPEC)


# ---- FLOP counts against closed-form formulas --------------------------------------------

@pytest.mark.parametrize("m,k,n", [(64, 128, 256), (3, 7, 5)])
def test_matmul_flops_forward_and_backward(m, k, n):
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(k, n, requires_grad=True)
    c = _cost(lambda a, b: a @ b, x, w)
    assert c["tensor_flops"] == 2 * m * k * n
    assert c["backward_tensor_flops"] == 4 * m * k * n  # grad of both operands
    with torch.no_grad():
        assert _cost(lambda a, b: a @ b, x, w)["backward_seconds"] == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_and_kv_bytes(causal):
    b, h, kv, s, d = 2, 8, 2, 64, 32

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    q = torch.randn(b, h, s, d, dtype=torch.bfloat16)
    k = torch.randn(b, kv, s, d, dtype=torch.bfloat16)
    v = torch.randn(b, kv, s, d, dtype=torch.bfloat16)
    with torch.no_grad():
        c = _cost(attn, q, k, v)
    scores = b * h * s * s * (0.5 if causal else 1.0)
    assert c["tensor_flops"] == 2 * scores * (d + d)  # QK^T and PV, fused: no S x S tensor
    # q, k, v read once (K/V at their own head count) and the output written once
    assert c["hbm_bytes"] == (2 * b * h * s * d + 2 * b * kv * s * d) * 2


def test_llama_mlp_flops():
    t, hid, inter = 16, 64, 176
    gate, up, down = (torch.nn.Linear(hid, inter, bias=False),
                      torch.nn.Linear(hid, inter, bias=False),
                      torch.nn.Linear(inter, hid, bias=False))

    def mlp(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    with torch.no_grad():
        c = _cost(mlp, torch.randn(t, hid), gate.weight, up.weight, down.weight)
    assert c["tensor_flops"] == 2 * t * 3 * hid * inter


def test_transformer_count_matches_closed_form_and_layer_extrapolation():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    b, s = 2, 32
    w = workload.count(cfg, "train", b, s)
    h, i, L, heads, kv = 64, 160, 4, 4, 2
    d = h // heads
    matmul = L * (h * h + 2 * h * kv * d + h * h + 3 * h * i) + h * 300  # q, k, v, o, mlp, head
    attn = L * 2 * (b * heads * s * s * 0.5) * 2 * d
    assert w.forward.tensor_flops == pytest.approx(2 * b * s * matmul + attn)
    assert w.shape.params == sum(p.numel() for p in _meta_model(cfg).parameters())
    # one and two layers extrapolated to four == four layers counted directly
    direct_f, direct_b, _, _ = workload._count_once(cfg, "causal-lm", "train", b, s, 0,
                                                    torch.bfloat16)
    for what in ("flops", "bytes", "vector"):
        assert w.forward.total(what) == pytest.approx(direct_f.total(what))
        assert w.backward.total(what) == pytest.approx(direct_b.total(what))


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_decode_counts_weights_and_kv_cache_once():
    cfg = workload.load_config("llama-3.1-8b")
    w = workload.count(cfg, "decode", 1, 1, ctx=4096)
    weights = (w.shape.params - 128256 * 4096) * 2  # bf16, embedding rows are gathered
    kv = 2 * 32 * 8 * 128 * 4097 * 2
    assert w.activation_bytes == kv
    assert w.forward.total("bytes", "tensor") == pytest.approx(weights + kv, rel=0.02)


def test_collectives_cost_ring_bytes():
    from neuronlocal.estimate.counting import op_cost

    x = torch.ones(1024)
    ar = op_cost(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "g"), {}, x)
    assert ar.engine == "comm" and ar.comm_bytes == pytest.approx(
        2 * (ar.group - 1) / ar.group * 4096)
    ag = op_cost(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 4, "g"), {},
                 torch.ones(4096))
    assert (ag.group, ag.comm_bytes) == (4, 3 * 4096)


def test_counter_costs_eager_neuron_ops_only():
    c = Counter(replace_attention=False, only_device="neuron")
    a, b = torch.ones(16, 32, device="neuron"), torch.ones(32, 8, device="neuron")
    with c:
        a @ b
        torch.ones(16, 32) @ torch.ones(32, 8)  # host work: not counted
    assert c.tally.tensor_flops == 2 * 16 * 32 * 8


def _mm_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def test_counter_costs_checkpointed_regions_by_their_bodies():
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(8, 8, device="neuron")

    def two_mm(x):
        return (x @ w) @ w

    def flops(fn, device="neuron"):
        c = Counter(replace_attention=False, only_device=device)
        with c:
            out = fn()
        assert c.error is None and not c.uncounted
        return c.tally.tensor_flops, out

    x = torch.randn(8, 8, device="neuron", requires_grad=True)
    plain, _ = flops(lambda: two_mm(x).sum().backward())
    ckpt, _ = flops(lambda: torch.utils.checkpoint.checkpoint(
        two_mm, x, use_reentrant=False).sum().backward())
    # The backward recomputes what it needs of the forward (x @ w; checkpoint stops there).
    assert ckpt == plain + _mm_flops(8, 8, 8)
    # The region as torch.compile traces it, and the RNG wrappers its compiled code calls.
    gm = make_fx(two_mm)(torch.randn(8, 8, device="neuron"))
    tagged, out = flops(lambda: torch.ops.higher_order.tag_activation_checkpoint(gm, x))
    assert tagged == 2 * _mm_flops(8, 8, 8) and torch.equal(out, two_mm(x))
    # Compiled code calls these on the host aliases of neuron tensors.
    rng, (state, drawn) = flops(lambda: run_and_save_rng_state(
        torch.ops.aten.rand.default, [4, 4], device="cpu"), None)
    torch.set_rng_state(state)
    assert rng == 0 and torch.equal(drawn, torch.rand(4, 4))  # the draw is the program's own
    a, b = torch.randn(4, 8), torch.randn(8, 8)
    replayed, out = flops(lambda: run_with_rng_state(torch.get_rng_state(),
                                                     torch.ops.aten.mm.default, a, b), None)
    assert replayed == _mm_flops(4, 8, 8) and torch.equal(out, a @ b)


@pytest.mark.parametrize("pred", [True, False])
def test_counter_costs_cond_and_while_loop_bodies(pred):
    from torch._higher_order_ops.cond import cond
    from torch._higher_order_ops.while_loop import while_loop
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(8, 8)
    x = torch.randn(8, 8)

    def one(x):
        return x @ w

    def two(x):
        return (x @ w) @ w

    p = torch.tensor(pred)
    c = Counter(replace_attention=False)
    with c:
        got = cond(p, two, one, (x,))
    assert torch.equal(got, cond(p, two, one, (x,)))
    assert c.tally.tensor_flops == (2 if pred else 1) * _mm_flops(8, 8, 8)

    def loop(x):
        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y @ w),
                          (torch.tensor(0), x))[1]

    c = Counter(replace_attention=False)
    with c:
        got = loop(x)
    assert torch.allclose(got, x @ w @ w @ w)
    assert c.tally.tensor_flops == 3 * _mm_flops(8, 8, 8)
    # A captured graph is costed on fake tensors: the costlier branch, one loop iteration.
    cost = estimate.graph_cost(make_fx(lambda x: cond(x.sum() > 0, two, one, (x,)))(x), [x],
                               SPEC)
    assert cost["tensor_flops"] == 2 * _mm_flops(8, 8, 8) and cost["uncounted"] == []
    cost = estimate.graph_cost(make_fx(loop)(x), [x], SPEC)
    assert cost["tensor_flops"] == _mm_flops(8, 8, 8)


# ---- hardware facts -------------------------------------------------------------------------

def test_chip_facts():
    assert (TRAINIUM3.physical_cores, TRAINIUM3.hbm_bytes, TRAINIUM3.bf16_flops,
            TRAINIUM3.hbm_bytes_per_s) == (8, 144 * GiB, 671e12, 4.9e12)
    assert (TRAINIUM2.physical_cores, TRAINIUM2.bf16_flops, TRAINIUM2.fp32_flops,
            TRAINIUM2.hbm_bytes, TRAINIUM2.hbm_bytes_per_s) == (8, 667e12, 181e12, 96 * GiB,
                                                                2.9e12)
    assert (TRAINIUM1.physical_cores, TRAINIUM1.bf16_flops, TRAINIUM1.fp32_flops,
            TRAINIUM1.hbm_bytes, TRAINIUM1.hbm_bytes_per_s) == (2, 190e12, 47.5e12, 32 * GiB,
                                                                820 * GiB)
    trn1 = rates.instance("trn1.32xlarge")
    assert trn1.chips == 16 and trn1.cores == 32
    assert SPEC.cores == 64 and SPEC.tensor_flops("bf16") == pytest.approx(667e12 / 4)
    assert rates.instance("trn2.48xlarge", 1).cores == 128


# ---- calibration -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated():
    """Every published row evaluated with the stored (fitted) factors."""
    cache = {}
    held = published.held_out()
    preds = [calibrate.predictor(r, calibrate.workload_for(r, cache)) for r in published.ROWS]
    return calibrate.Result(fitted.FACTORS, [(r, p(fitted.FACTORS), r.id in held)
                                             for r, p in zip(published.ROWS, preds,
                                                             strict=True)])


def test_published_rows_have_sources_and_a_fixed_split():
    ids = [r.id for r in published.ROWS]
    assert len(ids) == len(set(ids))
    assert all(r.source.startswith("https://") and r.sdk for r in published.ROWS)
    held = published.held_out()
    used = [r for r in published.ROWS if not r.excluded]
    for metric in {r.metric for r in used}:
        in_metric = [r.id for r in used if r.metric == metric]
        assert {i for i in in_metric if i in held} == set(in_metric[2::3])


def test_held_out_error_and_band_as_stated(evaluated):
    held = evaluated.errors(True)
    assert len(held) == fitted.HELD_OUT_ROWS
    assert float(np.median(held)) == pytest.approx(fitted.HELD_OUT_MEDIAN_ERROR, rel=1e-6)
    assert fitted.HELD_OUT_MEDIAN_ERROR <= 0.30  # the goal: median held-out error <= 30%
    assert evaluated.band() == pytest.approx(fitted.BAND, rel=1e-6)
    for metric, width in fitted.BANDS.items():  # per kind, never narrower than all rows'
        assert evaluated.band(metric) == pytest.approx(width, rel=1e-6) and width >= fitted.BAND
    inside = [r for r, p, h in evaluated.rows
              if h and 1 / (1 + fitted.BAND) - 1e-9 <= p / r.value <= 1 + fitted.BAND + 1e-9]
    assert len(inside) / len(held) >= calibrate.BAND_QUANTILE


def test_nelder_mead_is_deterministic():
    fn = lambda x: float(((x - np.array([0.3, -1.2])) ** 2).sum())  # noqa: E731
    a = calibrate._nelder_mead(fn, np.zeros(2))
    b = calibrate._nelder_mead(fn, np.zeros(2))
    assert np.array_equal(a, b) and np.allclose(a, [0.3, -1.2], atol=1e-4)


@pytest.mark.slow
def test_calibration_reproduces_fitted_factors():
    res = calibrate.fit()
    for k, v in fitted.FACTORS.as_dict().items():
        assert getattr(res.factors, k) == pytest.approx(v, rel=1e-6), k
    assert float(np.median(res.errors(True))) == pytest.approx(fitted.HELD_OUT_MEDIAN_ERROR,
                                                               rel=1e-6)


# ---- layouts and the CLI -------------------------------------------------------------------

def test_impossible_layouts_are_named():
    sh = workload.shape(workload.load_config("llama-3.1-8b"), 0)
    bad = problems(Layout("trn2.48xlarge", tp=6, dp=16), sh)
    assert any("96 cores" in p for p in bad) and any("not divisible by tp=6" in p for p in bad)
    assert problems(Layout("trn2.48xlarge", tp=4, dp=8, zero=3), sh) == []  # part of it
    assert problems(Layout("trn2.48xlarge", tp=8, dp=8), sh) == []
    assert problems(Layout("trn2.48xlarge", tp=8, dp=8, pp=3), sh)
    assert "unknown instance" in problems(Layout("p5.48xlarge"), sh)[0]


@pytest.mark.parametrize("argv,needle", [
    (["llama-3.1-8b", "--tp", "6", "--dp", "8"], "not divisible by tp=6"),
    (["llama-3.1-8b", "--tp", "8", "--dp", "16"], "make the product at most 64"),
    (["llama-3.1-8b", "--nodes", "2", "--tp", "8", "--dp", "4"], "use --nodes 1"),
    (["llama-3.1-8b", "--instance", "p5.48xlarge"], "unknown instance"),
    (["no-such-model"], "is not a preset"),
    (["llama-3.1-8b", "--seq", "0"], "argument --seq: '0' is not a whole number from 1"),
])
def test_cli_exit_2_names_the_problem(argv, needle, capsys):
    try:
        code = cli.main(["estimate", *argv])
    except SystemExit as e:  # argparse's own exit
        code = e.code
    assert code == 2
    assert needle in capsys.readouterr().err


def test_layout_on_part_of_an_instance_says_what_the_rest_does(capsys):
    """TP=4 x FSDP=8 uses 32 of a trn2.48xlarge's 64 logical cores: estimated, with the other
    32 named free; the suggested --dp uses them all."""
    argv = ["estimate", "llama-3.1-8b", "--tp", "4", "--dp", "8", "--fsdp"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "uses 32 of 64 logical cores; the other 32 are free" in out and "--dp 16" in out
    assert cli.main(["estimate", "llama-3.1-8b", "--tp", "4", "--dp", "16", "--fsdp",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["idle_cores"] == 0


def test_cli_training_estimate_has_band_throughput_memory_and_cost(capsys):
    argv = ["estimate", "llama-3.1-8b", "--instance", "trn2.48xlarge", "--tp", "8", "--dp", "8",
            "--fsdp", "--seq", "4096", "--json"]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    lo, hi = d["band_s"]
    assert lo < d["step_s"] < hi and hi / d["step_s"] == pytest.approx(
        1 + fitted.BANDS["seq_per_s"])
    assert 0 < d["mfu"] < 1 and d["fits"] and d["tokens_per_s"] == pytest.approx(
        8 * 4096 / d["step_s"])
    cost = d["usd_per_million_tokens"]
    assert cost[0] == pytest.approx(35.76 / 3600 * 1e6 / d["tokens_per_s"])
    assert cli.main(argv[:-1] + ["--price-per-hour", "10"]) == 0
    text = capsys.readouterr().out
    assert "band" in text and "at $10.00/h" in text and "fits" in text


def test_cli_decode_and_unknown_price(capsys):
    assert cli.main(["estimate", "llama-3.1-8b", "--instance", "trn3.48xlarge", "--tp", "8",
                     "--mode", "decode", "--seq", "1", "--ctx", "2048"]) == 0
    out = capsys.readouterr().out
    assert "decode step" in out and "no price known for trn3.48xlarge" in out


def test_does_not_fit_is_reported():
    est = estimate.estimate("llama-3.1-70b", Layout("trn2.48xlarge", tp=1, dp=64, seq=4096))
    assert not est.fits and est.hbm["optimizer"] > 0


# ---- presets and architectures ------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(presets.PUBLISHED))
def test_preset_builds_with_the_published_parameter_count(name):
    """Each preset of a current model builds (on meta) to the size its model card states."""
    params = workload.param_count(workload.load_config(name)) / 1e9
    assert params == pytest.approx(presets.PUBLISHED[name], rel=0.02)


# Values of the models' published config.json files (Hugging Face repos meta-llama/
# Llama-3.1-8B, Llama-3.2-1B, Llama-3.2-3B, Llama-3.3-70B-Instruct, Qwen/Qwen3-8B,
# Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, openai/gpt-oss-20b, openai/gpt-oss-120b,
# mistralai/Mistral-7B-Instruct-v0.2, mistralai/Mixtral-8x7B-v0.1).
_LLAMA3_POSITIONS = {"vocab_size": 128256, "max_position_embeddings": 131072,
                     "num_key_value_heads": 8}
PUBLISHED_CONFIGS = {
    "llama-3.2-1b": {**_LLAMA3_POSITIONS, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64,
                     "tie_word_embeddings": True,
                     "rope": {"rope_type": "llama3", "factor": 32.0, "rope_theta": 500000.0}},
    "llama-3.2-3b": {**_LLAMA3_POSITIONS, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128,
                     "tie_word_embeddings": True,
                     "rope": {"rope_type": "llama3", "factor": 32.0, "rope_theta": 500000.0}},
    "llama-3.3-70b": {**_LLAMA3_POSITIONS, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64,
                      "rope": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}},
    "qwen3-235b-a22b": {"hidden_size": 4096, "moe_intermediate_size": 1536,
                        "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                        "vocab_size": 151936, "max_position_embeddings": 40960},
    "gpt-oss-120b": {"hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                     "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
                     "num_experts_per_tok": 4, "vocab_size": 201088,
                     "max_position_embeddings": 131072},
    "mistral-7b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                   "max_position_embeddings": 32768, "sliding_window": None,
                   "rope": {"rope_theta": 1000000.0}},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "tie_word_embeddings": False,
                     "rope": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                              "original_max_position_embeddings": 8192}},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960,
                 "tie_word_embeddings": False, "rope": {"rope_theta": 1000000.0}},
    "qwen3-30b-a3b": {"hidden_size": 2048, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                      "vocab_size": 151936, "max_position_embeddings": 40960},
    "gpt-oss-20b": {"hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
                    "max_position_embeddings": 131072, "sliding_window": 128,
                    "rope": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                             "original_max_position_embeddings": 4096}},
    "mixtral-8x7b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rope": {"rope_theta": 1000000.0}},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_preset_config_matches_the_published_config(name):
    cfg = workload.load_config(name)
    want = dict(PUBLISHED_CONFIGS[name])
    rope = want.pop("rope", {})
    assert {k: getattr(cfg, k) for k in want} == want
    assert {k: cfg.rope_parameters[k] for k in rope} == rope
    if name == "gpt-oss-20b":
        assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]


def _tiny_gpt_oss(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 256,
        "layer_types": ["sliding_attention", "full_attention"] * 2}))
    return path


def test_model_without_sdpa_is_counted_with_fused_attention_and_its_experts(tmp_path, capsys):
    """GPT-OSS has no SDPA path in transformers (attention sinks): it is counted with one
    fused attention op per layer, and its experts' grouped matmuls as tensor-engine work
    for the experts each token is routed to."""
    cfg = workload.load_config(str(_tiny_gpt_oss(tmp_path)))
    tokens, layers = 32, 4
    work = workload.count(cfg, "prefill", 1, tokens)
    fused = [op for op in work.forward.ops if op.engine == "tensor" and op.vector]
    assert sum(work.forward.ops[op] for op in fused) == layers  # one attention per layer
    experts = 2 * tokens * 2 * 3 * 64 * 64 * layers  # top-2 of gate, up and down projections
    assert work.forward.tensor_flops > experts
    assert cli.main(["estimate", str(tmp_path / "config.json"), "--tp", "2", "--seq", "32"]) == 0
    assert "step time" in capsys.readouterr().out


def test_grouped_matmul_flops():
    from neuronlocal.estimate.counting import Counter as OpCounter

    a = torch.randn(16, 8, dtype=torch.bfloat16)
    b = torch.randn(2, 8, 8, dtype=torch.bfloat16)
    with OpCounter() as c:
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32))
    assert c.tally.tensor_flops == 2 * 16 * 8 * 8


# ---- estimates on compiled graphs, eager steps and the run report --------------------------

def test_compiled_graph_record_carries_its_estimate():
    torch.neuron.reset_dynamo_metrics()
    x = torch.randn(32, 64, device="neuron")
    w = torch.randn(64, 16, device="neuron")
    torch.compile(lambda a, b: torch.relu(a @ b), backend="neuron")(x, w)
    est = torch.neuron.get_dynamo_metrics()["graphs"][-1]["estimate"]
    assert est["tensor_flops"] == 2 * 32 * 64 * 16
    assert est["band"][0] < est["seconds"] < est["band"][1] and not est["calibrated"]


def test_graph_fed_a_non_leaf_is_costed_with_its_backward():
    """Activations cross graph breaks as non-leaf tensors: the graph's own backward is
    costed (2 matmuls: grads of h and w), not the history of its input."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    w = torch.randn(8, 8, device="neuron", requires_grad=True)
    h = torch.randn(4, 8, device="neuron", requires_grad=True) * 2
    torch.compile(lambda h: (h @ w).sum(), backend=keep)(h).backward()
    (gm, inputs), = graphs
    cost = estimate.graph_cost(gm, inputs, SPEC)
    assert cost["backward_tensor_flops"] == 2 * _mm_flops(4, 8, 8)


def test_a_graph_estimate_that_fails_is_recorded_and_the_graph_still_runs(monkeypatch):
    from neuronlocal.core import dynamo_metrics

    def boom(*args):
        raise RuntimeError("estimator broke")

    rec = dynamo_metrics.GraphRecord(0, "g_0", None, 1, [], [], 0.0, "miss", "k", False)
    monkeypatch.setattr(dynamo_metrics, "last_record", lambda: rec)
    monkeypatch.setattr(estimate, "graph_cost_later", boom)
    run = capture.attach(None, [], lambda x: x + 1)
    assert run(1) == 2
    assert rec.estimate == {"not_estimated": "RuntimeError: estimator broke"}
    rec.pending_estimate = lambda: boom()  # fails later, when the report asks for it
    assert rec.as_dict()["estimate"] == {"not_estimated": "RuntimeError: estimator broke"}


def test_capture_costs_eager_steps_and_graph_calls_and_leaves_no_mode():
    assert torch._C._len_torch_dispatch_stack() == 0
    model = torch.nn.Linear(64, 64).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, device="neuron")
    with capture.capturing() as cap:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch._C._len_torch_dispatch_stack() == 0
    snap = cap.snapshot()
    assert [s["step"] for s in snap["steps"]] == [0, 1]
    step = snap["steps"][1]
    assert step["tensor_flops"] == 2 * 8 * 64 * 64 * 2  # forward + weight gradient
    assert step["band_s"][0] < step["estimated_s"] < step["band_s"][1]
    assert snap["summary"]["usd_per_hour"] == rates.PRICES[snap["instance"]].usd_per_hour


def test_eager_steps_pay_one_kernel_launch_per_op_and_compiled_is_shown_beside():
    """TorchNeuron runs each eager op as its own kernel: a step of eager ops costs its
    roofline (unfused) plus a launch per op, at an assumed cost whose range widens the
    band; the same ops compiled (fused, one graph launch) are estimated next to it."""
    from neuronlocal.estimate import view
    from neuronlocal.estimate.roofline import EAGER_LAUNCH_MIN_S, eager_launch

    per, low, high = eager_launch(fitted.FACTORS)
    assert low == EAGER_LAUNCH_MIN_S < per < high == fitted.FACTORS.launch
    assert per == pytest.approx(math.sqrt(low * high))
    model = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(64, 64),
                                                                 torch.nn.GELU()))).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, device="neuron")
    with capture.capturing() as cap:
        model(x).sum().backward()
        opt.step()
    snap = cap.snapshot()
    step = snap["steps"][0]
    n = step["eager_launches"]
    assert n == step["eager_ops"] > 20
    assert step["launch_s"] == pytest.approx(n * per)
    assert step["estimated_s"] > n * per > step["compiled_s"] > 0
    lo, hi = step["band_s"]
    assert lo < step["estimated_s"] < hi and lo > n * low and hi > n * high
    assert step["compiled_band_s"][0] < step["compiled_s"] < step["compiled_band_s"][1]
    text = view.text(snap)
    assert "compiled ms" in text and "eager as run" in text
    assert "no published per-launch figure exists" in text and "faster" in text


def test_full_size_estimate_shows_eager_next_to_compiled(capsys):
    est = estimate.estimate("llama-3.1-8b", Layout("trn2.48xlarge", tp=8, dp=8, seq=4096))
    step, lo, hi = est.eager
    assert lo < step < hi and step > est.step and est.launches > 1000
    assert est.as_dict()["eager_step_s"] == step
    assert cli.main(["estimate", "llama-3.1-8b", "--tp", "8", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "eager step" in out and "no published per-launch figure exists" in out


def test_run_report_shows_estimated_step_and_cost(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(32, 32).to('neuron')\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "f = torch.compile(m, backend='neuron')\n"
        "for _ in range(3):\n"
        "    f(torch.ones(4, 32, device='neuron')).sum().backward(); opt.step()\n")
    assert cli.main(["run", "--report", str(tmp_path / "rep"), str(script)]) == 0
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    est = rep["ranks"][0]["estimate"]
    assert len(est["steps"]) == 3 and est["graphs"][0]["calls"] == 3
    assert est["summary"]["band_s"][0] < est["summary"]["estimated_step_s"]
    assert rep["ranks"][0]["graphs"][0]["estimate"]["tensor_flops"] == 2 * 4 * 32 * 32
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "Estimated Trainium time and cost" in html and "per 1000 steps" in html
    assert "estimated Trainium step" in capfd.readouterr().err


def test_factors_roofline_picks_the_slowest_engine():
    from neuronlocal.estimate.counting import OpCost, Tally
    from neuronlocal.estimate.roofline import seconds

    f = Factors(1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0)
    t = Tally()
    t.add(OpCost("tensor", flops=SPEC.tensor_flops("bf16"), bytes=1.0))  # 1 s of compute
    assert seconds(t, SPEC, f) == pytest.approx(1.0)
    t.add(OpCost("tensor", flops=1.0, bytes=SPEC.hbm_bytes_per_s * 2))  # 2 s of HBM
    assert seconds(t, SPEC, f) == pytest.approx(3.0)
    assert math.isclose(seconds(t, SPEC, Factors(0.5, 0.5, 1, 1, 1, 0, 0)), 6.0)


def test_docs_tables_are_current(evaluated):
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "estimate.md").read_text()
    assert calibrate.docs_block(evaluated) in doc


def test_step_compile_seconds_are_split_from_run_time(monkeypatch):
    """A first step that compiles for two minutes: its compile seconds are recorded apart,
    and the host step time of the summary excludes them."""
    from types import SimpleNamespace

    from neuronlocal.estimate import capture

    ticks = iter([0.0, 122.0, 122.4, 122.8])  # Capture(), then three step ends
    compiled = iter([121.5, 121.5, 121.5])  # compile seconds recorded so far, at each end
    monkeypatch.setattr(capture, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(capture, "_compile_seconds", lambda: next(compiled))
    cap = capture.Capture()
    for _ in range(3):
        cap.steps.append(cap._close())
    steps = cap.steps.kept()
    assert [round(s["compile_s"], 6) for s in steps] == [121.5, 0.0, 0.0]
    assert [round(s["host_s"] - s["compile_s"], 6) for s in steps] == [0.5, 0.4, 0.4]
    assert cap.snapshot()["summary"]["host_step_s"] == pytest.approx(0.4)


def test_kernel_op_is_costed_as_the_one_fused_kernel_it_stands_for():
    """neuronlocal::rms_norm is one NKI kernel on Trainium: one pass (x in, weight, y out),
    not the pieces of its CPU body."""
    from neuronlocal import kernels as K
    from neuronlocal.estimate.counting import Counter

    x, w = torch.randn(64, 256), torch.ones(256)
    with Counter() as c:
        K.rms_norm(x, w)
    ((cost, n),) = c.tally.ops.items()
    assert n == 1 and cost.engine == "vector"
    assert cost.bytes == 2 * x.numel() * 4 + w.numel() * 4


def test_an_optimizer_stepping_other_optimizers_is_one_step():
    """torchtitan's OptimizersContainer is an Optimizer whose step runs the inner ones: each
    outer step is one training step, not one per optimizer; an inner step that raised does
    not hide the next steps."""

    class Container(torch.optim.Optimizer):
        def __init__(self, parts):
            self.parts = parts
            super().__init__([p for o in parts for g in o.param_groups for p in g["params"]],
                             {})

        def step(self, closure=None):
            for o in self.parts:
                o.step()

    a, b = (torch.nn.Linear(8, 8).to("neuron") for _ in range(2))
    inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    opt = Container(inner)
    x = torch.randn(4, 8, device="neuron")
    with capture.capturing() as cap:
        for _ in range(3):
            (a(x) + b(x)).sum().backward()
            opt.step()
        original, inner[1].step = inner[1].step, None  # the next outer step raises inside
        with pytest.raises(TypeError):
            opt.step()
        inner[1].step = original
        opt.step()
        inner[0].step()  # a bare inner optimizer's step is a step of its own
    assert [s["step"] for s in cap.snapshot()["steps"]] == [0, 1, 2, 3, 4]


def test_step_records_are_bounded_for_any_run_length(monkeypatch):
    """A million-step run keeps the first and last steps whole and the rest as totals: the
    report's steps, its rank file and the capture's memory stay bounded, and the report
    says how many steps were summarised."""
    import json

    from neuronlocal.estimate import view
    from neuronlocal.report import render

    cap = capture.Capture()
    step = {"step": 0, "host_s": 0.01, "compile_s": 0.0, "estimated_s": 0.002,
            "band_s": [0.001, 0.003], "eager_s": 0.002, "graph_s": 0.0, "eager_ops": 30,
            "eager_launches": 30, "launch_s": 0.001, "compiled_s": 0.0005,
            "compiled_band_s": [0.0004, 0.0006], "graph_calls": 0, "tensor_flops": 1e6}
    for i in range(1_000_000):
        cap.steps.append({**step, "step": i})
    snap = cap.snapshot()
    head, tail = capture.StepWindow.HEAD, capture.StepWindow.TAIL
    assert len(snap["steps"]) == head + tail
    assert snap["steps"][head - 1]["step"] == head - 1 and snap["steps"][-1]["step"] == 999_999
    s = snap["summary"]
    assert s["steps"] == 1_000_000 and s["steps_summarised"] == 1_000_000 - head - tail
    assert s["totals"]["eager_ops"] == 30_000_000
    assert len(json.dumps(snap)) < 2**20  # ~250 bytes a kept step
    rank = {"schema": 1, "rank": 0, "world_size": 1, "run": {}, "estimate": snap}
    line = view.headlines({"ranks": [rank]})[0]
    assert f"{1_000_000 - head - tail} steps in between are summarised" in line
    assert render.merge([rank])["complete"]


def test_real_optimizer_steps_beyond_the_window_are_summarised(monkeypatch):
    monkeypatch.setattr(capture.StepWindow, "HEAD", 2)
    monkeypatch.setattr(capture.StepWindow, "TAIL", 3)
    model = torch.nn.Linear(4, 4).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture.capturing() as cap:
        for _ in range(9):
            model(torch.ones(2, 4, device="neuron")).sum().backward()
            opt.step()
    snap = cap.snapshot()
    assert [s["step"] for s in snap["steps"]] == [0, 1, 6, 7, 8]
    assert snap["summary"]["steps"] == 9 and snap["summary"]["steps_summarised"] == 4
