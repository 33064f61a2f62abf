"""Does a transformers model run on neuron? One model, every mode, compared with CPU.

`shrink(config)` derives a tiny config from any architecture's config class by name
(hidden sizes, layers, heads, vocab, experts, sub-configs), so random weights are cheap.
`check_model(...)` then runs on CPU and on neuron: eager forward + backward, compiled
forward (backend neuron), static-cache `generate()` (auto-compiled on neuron), and one
optimizer step, and compares logits, loss, grads, tokens and parameters. A mode that
fails on CPU too is not held against neuron.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

MODES = ("eager", "compile", "generate", "train")

_SIZES: dict[str, int] = {
    # widths
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "dim": 64,
    "word_embed_proj_dim": 64, "hidden_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 64, "ffn_hidden_size": 128,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2, "n_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16, "attention_head_size": 16,
    # vocab and positions
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "max_sequence_length": 128, "seq_length": 128,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    # latent attention and low-rank projections
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16,
    # convolutions / state spaces
    "state_size": 8, "ssm_state_size": 8, "conv_kernel": 4, "time_step_rank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    "sliding_window": 32, "attention_chunk_size": 32, "num_memory_tokens": 0,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")


def shrink(config: Any, vocab: int = 256) -> Any:
    """A tiny copy of `config`: every known size attribute set small, sub-configs too."""
    cfg = copy.deepcopy(config)
    for name, value in _SIZES.items():
        current = getattr(cfg, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            setattr(cfg, name, value)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads % max(kv, 1):
        cfg.num_key_value_heads = 1
    for name in _TOKEN_IDS:
        tid = getattr(cfg, name, None)
        if isinstance(tid, int) and tid >= vocab:
            setattr(cfg, name, vocab - 1)
        elif isinstance(tid, list):
            setattr(cfg, name, [t if t < vocab else vocab - 1 for t in tid])
    layers = getattr(cfg, "num_hidden_layers", None)
    for name in ("layer_types", "block_types", "layers_block_type", "hybrid_override_pattern"):
        val = getattr(cfg, name, None)
        if isinstance(val, (list, str)) and isinstance(layers, int) and len(val) > layers:
            setattr(cfg, name, val[:layers])
    for name in ("text_config", "vision_config", "audio_config", "decoder", "encoder"):
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            setattr(cfg, name, shrink(sub, vocab))
    for name in ("use_cache",):
        if hasattr(cfg, name):
            setattr(cfg, name, True)
    if hasattr(cfg, "tie_word_embeddings") and getattr(cfg, "vocab_size", vocab) != vocab:
        cfg.vocab_size = vocab
    return cfg


@dataclass
class ModeResult:
    cpu_ok: bool = False
    neuron_ok: bool = False
    max_diff: float | None = None
    error: str | None = None  # "ErrorClass: message" of the first failure


@dataclass
class ModelReport:
    model_type: str
    architecture: str
    status: str = "pending"  # pass | neuron-fail | cpu-fail | unsupported | timeout | crash
    modes: dict[str, ModeResult] = field(default_factory=dict)
    seconds: float = 0.0
    compiles: int = 0
    peak_hbm: int = 0
    cores: int = 1
    params: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes, calls
    downcast_ops: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = max(b.abs().max().item(), 1.0)
    return (a - b).abs().max().item() / scale


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _run_mode(res: ModeResult, cpu_fn: Any, neuron_fn: Any, tol: float) -> None:
    try:
        ref = cpu_fn()
        res.cpu_ok = True
    except Exception as e:  # noqa: BLE001 - a CPU failure is a result, not a crash
        res.error = "cpu: " + _err(e)
        return
    try:
        got = neuron_fn()
    except Exception as e:  # noqa: BLE001
        res.error = _err(e)
        res.error += "\n" + "".join(traceback.format_exception(e)[-3:])[-800:]
        return
    diffs = [_close(g, r) if isinstance(r, torch.Tensor) and r.is_floating_point()
             else float(not torch.equal(g.cpu(), r.cpu())) for g, r in zip(got, ref, strict=True)]
    res.max_diff = max(diffs) if diffs else 0.0
    res.neuron_ok = res.max_diff <= tol
    if not res.neuron_ok:
        res.error = f"Mismatch: max relative difference {res.max_diff:.3g} > {tol:g}"


def check_model(model_type: str, architecture: str, config: Any | None = None,
                modes: tuple[str, ...] = MODES, seq: int = 12) -> ModelReport:
    """Runs one architecture on CPU and neuron in every mode; see the module docstring."""
    import transformers
    from transformers import CONFIG_MAPPING

    import torch_neuronx
    from neuronlocal.compile import metrics
    from neuronlocal.eager.tracking import get_fallback_traffic

    rep = ModelReport(model_type, architecture)
    start = time.perf_counter()
    try:
        cfg = shrink(config if config is not None else CONFIG_MAPPING[model_type]())
        cls = getattr(transformers, architecture)
        torch.manual_seed(0)
        cpu = cls(cfg).eval()
        dev = copy.deepcopy(cpu).to("neuron")
    except Exception as e:  # noqa: BLE001
        rep.status, rep.error = "unsupported", "build: " + _err(e)
        rep.seconds = time.perf_counter() - start
        return rep
    rep.params = sum(p.numel() for p in cpu.parameters())
    vocab = int(getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size)
    torch.manual_seed(1)
    ids = torch.randint(3, vocab - 1, (2, seq))
    ids_n = ids.to("neuron")
    metrics.reset_dynamo_metrics()
    torch_neuronx.clear_op_tracking()
    torch.neuron.reset_peak_memory_stats()

    def fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(x, labels=x)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return [_logits(out), out.loss, *grads[:4], *grads[-4:]]

    if "eager" in modes:
        rep.modes["eager"] = m = ModeResult()
        _run_mode(m, lambda: fwd_bwd(cpu, ids), lambda: fwd_bwd(dev, ids_n), 2e-3)
    if "compile" in modes:
        rep.modes["compile"] = m = ModeResult()
        with torch.no_grad():
            _run_mode(m, lambda: [_logits(cpu(ids))],
                      lambda: [_logits(torch.compile(dev, backend="neuron")(ids_n))], 2e-3)
    if "generate" in modes:
        rep.modes["generate"] = m = ModeResult()

        def gen(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
            with torch.no_grad():
                return [model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                       cache_implementation="static")]
        if getattr(cpu, "_can_compile_fullgraph", True) is False:
            m.error = "unsupported: model does not support a static cache"
        else:
            _run_mode(m, lambda: gen(cpu, ids), lambda: gen(dev, ids_n), 0.0)
    if "train" in modes:
        rep.modes["train"] = m = ModeResult()

        def step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
            torch.manual_seed(2)  # same dropout masks: CPU and neuron draw from equal seeds
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model.zero_grad(set_to_none=True)
            model(x, labels=x).loss.backward()
            opt.step()
            model.eval()
            params = list(model.parameters())
            return [p.detach() for p in params[:4] + params[-4:]]
        _run_mode(m, lambda: step(cpu, ids), lambda: step(dev, ids_n), 2e-3)
    rep.seconds = time.perf_counter() - start
    rep.compiles = torch.neuron.get_dynamo_metrics()["num_graphs"]  # hits compile on Trainium too
    rep.peak_hbm = torch.neuron.max_memory_allocated()
    rep.fallback_ops = torch_neuronx.get_fallback_ops()
    rep.fallback_traffic = get_fallback_traffic()
    rep.downcast_ops = torch_neuronx.get_downcast_ops()
    rep.status = classify(rep)
    return rep


def classify(rep: ModelReport) -> str:
    ran = [m for m in rep.modes.values() if m.cpu_ok]
    if not ran:
        rep.error = rep.error or next((m.error for m in rep.modes.values() if m.error), None)
        return "cpu-fail"
    if any(not m.neuron_ok for m in ran):
        bad = next(m for m in ran if not m.neuron_ok)
        rep.error = rep.error or bad.error
        return "neuron-fail"
    return "pass"
