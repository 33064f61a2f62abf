"""Full-size workloads counted on the meta device: nothing is allocated, every op is costed.

A transformers model is built on `meta` from its config and run once: a training step
(forward, loss, backward), a prefill, one decode step against a static KV cache of a given
length, or an encoder forward. Models whose layers are identical are counted with one and
with two layers and extrapolated to the full depth, which is exact for them and keeps a
405B count under a second. Saved activations are measured with saved-tensor hooks.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuronlocal.core.files import load_input_json
from neuronlocal.estimate.counting import Counter, Tally
from neuronlocal.estimate.presets import PRESETS

# What a model is run as: causal LM (train / prefill / decode), or one of the heads the
# published encoder and vision rows used.
ARCH_CLASSES = {"bert-pretraining": "BertForPreTraining", "encoder": "AutoModel",
                "image-classification": "ViTForImageClassification"}


def _cache_keyword() -> str:
    """transformers 5 renamed `past_key_values` to `cache` on model forwards."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else \
        "past_key_values"


def param_count(cfg: Any) -> int:
    """Parameters of the causal LM `cfg` builds, from meta builds of one and two repeats of
    its layer stack (a 405B model in a second); the whole stack when it does not repeat."""
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    period = _layer_period(cfg)
    if not period or layers <= 2 * period:
        return _params(_model(cfg, "causal-lm", torch.bfloat16))
    one = _params(_model(_with_layers(cfg, period), "causal-lm", torch.bfloat16))
    two = _params(_model(_with_layers(cfg, 2 * period), "causal-lm", torch.bfloat16))
    return one + (two - one) * (layers // period - 1)


class WorkloadError(ValueError):
    """The model or its config cannot be counted (the CLI's exit status 2)."""


# Sizes a transformers config needs to be positive whole numbers: a zero, a negative, a
# float or a huge value there fails deep inside transformers (ZeroDivisionError) or
# overflows a tensor size. Checked in every sub-config (text_config, vision_config, ...).
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
               "intermediate_size", "vocab_size", "head_dim", "max_position_embeddings",
               "n_embd", "n_head", "n_layer", "n_positions", "n_heads", "n_layers", "d_model",
               "num_heads", "num_layers", "encoder_layers", "decoder_layers",
               "encoder_attention_heads", "decoder_attention_heads", "ffn_dim", "d_ff")
MAX_SIZE_FIELD = 2**31 - 1


def size_problem(raw: dict[str, Any], where: str, depth: int = 0) -> str | None:
    """Why a config's sizes cannot be used (one line naming the field), or None."""
    for key, value in raw.items():
        if isinstance(value, dict) and depth < 4:
            problem = size_problem(value, f"{where}: {key}", depth + 1)
            if problem:
                return problem
        elif key in SIZE_FIELDS and value is not None and (
                isinstance(value, bool) or not isinstance(value, int)
                or not 1 <= value <= MAX_SIZE_FIELD):
            shown = repr(value) if len(repr(value)) < 40 else f"{repr(value)[:37]}..."
            return (f"{where}: {key} is {shown}; it must be a whole number from 1 to "
                    f"{MAX_SIZE_FIELD} (fix that field in config.json)")
    return None


def config_from_dict(cls: Any, raw: dict[str, Any], where: str) -> Any:
    """`cls(**raw)` after the size check; any failure of transformers' own checks is a
    WorkloadError naming the file (a config's __init__ can raise anything)."""
    problem = size_problem(raw, where)
    if problem:
        raise WorkloadError(problem)
    try:
        return cls(**raw)
    except Exception as e:  # noqa: BLE001 - transformers' config code can raise anything
        raise WorkloadError(f"{where}: transformers cannot build this config "
                            f"({type(e).__name__}: {e}); fix config.json") from None


def load_config(spec: str) -> Any:
    """A transformers config from a preset name, a model type, or a config.json path."""
    from transformers import CONFIG_MAPPING

    if spec in PRESETS:
        raw = dict(PRESETS[spec])
    elif spec in CONFIG_MAPPING:
        return CONFIG_MAPPING[spec]()
    elif Path(spec).is_file() or Path(spec, "config.json").is_file():
        path = Path(spec) if Path(spec).is_file() else Path(spec, "config.json")
        try:
            raw = load_input_json(path, 4 * 2**20, "a model's config.json")
        except ValueError as e:
            raise WorkloadError(str(e)) from None
    else:
        raise WorkloadError(f"{spec!r} is not a preset ({', '.join(PRESETS)}), a transformers "
                            "model type, or a config.json path.")
    if not isinstance(raw, dict):
        raise WorkloadError(f"{spec}: a config.json holds one JSON object, not a "
                            f"{type(raw).__name__}")
    mt = raw.pop("model_type", None)
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        raise WorkloadError(f"{spec}: 'model_type' is {mt!r}, not a transformers model type.")
    return config_from_dict(CONFIG_MAPPING[mt], raw, spec)


@dataclass
class Shape:
    """What the parallel layout needs to know about a model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int


def shape(cfg: Any, params: int) -> Shape:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "dim", 0))
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_heads", 1))
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // max(heads, 1))
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layers", 1))
    return Shape(layers, hidden, heads, kv, head_dim, params)


@dataclass
class Workload:
    """One micro-batch of a model, whole (not yet split over cores)."""

    forward: Tally
    backward: Tally
    activation_bytes: float  # saved for backward (training) or KV cache (decode)
    shape: Shape


def _layer_period(cfg: Any) -> int:
    """The number of layers after which the stack repeats (1: identical layers, 2: GPT-OSS's
    alternating sliding and full attention), or 0 when it does not repeat evenly."""
    if getattr(cfg, "mlp_only_layers", None) or getattr(cfg, "decoder_sparse_step", 1) not in (
            0, 1) or any(getattr(cfg, k, 0) for k in ("first_k_dense_replace",
                                                       "moe_layer_freq")):
        return 0  # some layers dense, some MoE
    types = list(getattr(cfg, "layer_types", None) or [])
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    for p in range(1, 5):
        if (not types or all(t == types[i % p] for i, t in enumerate(types))) and \
                layers % p == 0:
            return p
    return 0


def _with_layers(cfg: Any, n: int) -> Any:
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = n
    types = getattr(c, "layer_types", None)
    if isinstance(types, list):
        c.layer_types = types[:n]
    return c


FUSED_ATTENTION = "neuronlocal_fused_count"


def _fused_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
    """Attention for counting only, through SDPA (which the counter costs as one fused
    kernel): for models transformers runs without SDPA because of an extra input SDPA lacks,
    such as GPT-OSS's attention sinks (one logit per head and row, left out of the count)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("s_aux", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attention_for(cls: Any) -> str:
    """SDPA where the model supports it, else the counting-only fused attention: on Trainium
    attention runs as one fused kernel either way, and transformers' eager attention would be
    counted as separate score matrices written to HBM."""
    if getattr(cls, "_supports_sdpa", True):
        return "sdpa"
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_ATTENTION, _fused_attention)
    return FUSED_ATTENTION


def _model(cfg: Any, arch: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    if arch in ARCH_CLASSES:
        name = ARCH_CLASSES[arch]
        cls = getattr(transformers, name)
        if name.startswith("Auto"):
            cls = cls._model_mapping[type(cfg)]
    else:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    cfg._attn_implementation = _attention_for(cls)
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(dtype)


def _params(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _inputs(cfg: Any, arch: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    if arch == "image-classification":
        return {"pixel_values": torch.zeros(batch, 3, cfg.image_size, cfg.image_size,
                                            device="meta", dtype=torch.bfloat16)}
    return {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta")}


class _Saved:
    """Bytes of the activations autograd saves (parameters and their views excluded)."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.bytes = 0.0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        root = t._base if t._base is not None else t
        if id(root) not in self.params and id(root) not in self.seen:
            self.seen.add(id(root))
            self.bytes += root.numel() * root.element_size()
        return t


def _count_once(cfg: Any, arch: str, mode: str, batch: int, seq: int, ctx: int,
                dtype: torch.dtype) -> tuple[Tally, Tally, float, int]:
    model = _model(cfg, arch, dtype)
    params = _params(model)
    inputs = _inputs(cfg, arch, batch, seq)
    fwd, bwd = Counter(), Counter()
    saved = _Saved({id(p) for p in model.parameters()})
    if mode == "train":
        model.train()
        with fwd, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = model(**inputs, **({"labels": inputs["input_ids"]} if arch == "causal-lm"
                                     else {}))
            loss = out.loss if getattr(out, "loss", None) is not None else (
                out[0].float().sum())
        with bwd:
            loss.backward()
        return fwd.tally, bwd.tally, saved.bytes, params
    model.eval()
    with torch.no_grad():
        if mode == "decode":
            from transformers import StaticCache

            cache = StaticCache(config=cfg, max_cache_len=ctx + 1)
            kw = {_cache_keyword(): cache}
            prompt = torch.zeros(batch, ctx, dtype=torch.long, device="meta")
            model(input_ids=prompt, **kw, use_cache=True, logits_to_keep=1)
            step = torch.zeros(batch, 1, dtype=torch.long, device="meta")
            pos = torch.full((1,), ctx, dtype=torch.long, device="meta")
            with fwd:
                model(input_ids=step, **kw, use_cache=True,
                      cache_position=pos, logits_to_keep=1)
            kv = sum(t.numel() * t.element_size() for layer in cache.layers
                     for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                     if isinstance(t, torch.Tensor))
            return fwd.tally, bwd.tally, float(kv), params
        kwargs: dict[str, Any] = {}
        if mode == "prefill":
            kwargs = {"use_cache": False, "logits_to_keep": 1}
        with fwd:
            model(**inputs, **kwargs)
    return fwd.tally, bwd.tally, 0.0, params


@contextmanager
def _meta_friendly() -> Iterator[None]:
    """transformers settings for counting on meta: grouped K/V are read once (not repeated),
    and the packed-sequence probe (which reads a value, impossible on meta) finds none."""
    from transformers import masking_utils

    old_env = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    old_probe = getattr(masking_utils, "find_packed_sequence_indices", None)
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    if old_probe is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        if old_probe is not None:
            masking_utils.find_packed_sequence_indices = old_probe
        if old_env is None:
            os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = old_env


def _count(cfg: Any, mode: str, batch: int, seq: int, ctx: int, arch: str,
           dtype: torch.dtype) -> tuple[Tally, Tally, float, float]:
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    period = _layer_period(cfg)
    if not period or layers <= 2 * period:
        return _count_once(cfg, arch, mode, batch, seq, ctx, dtype)
    # one and two repeats of the period; the rest of the stack repeats the difference
    units = layers // period
    f1, b1, a1, p1 = _count_once(_with_layers(cfg, period), arch, mode, batch, seq, ctx, dtype)
    f2, b2, a2, p2 = _count_once(_with_layers(cfg, 2 * period), arch, mode, batch, seq, ctx,
                                 dtype)
    return (f2.extrapolate(f1, units), b2.extrapolate(b1, units), a1 + (a2 - a1) * (units - 1),
            p1 + (p2 - p1) * (units - 1))


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An error's first line, cut at `limit`: transformers' "Unrecognized configuration
    class" lists every model type in 3 KB; the command's error stays one short line."""
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def count(cfg: Any, mode: str, batch: int, seq: int, ctx: int = 0, arch: str = "causal-lm",
          dtype: torch.dtype = torch.bfloat16) -> Workload:
    """Counts one micro-batch: mode "train", "prefill", "decode" (one token, `ctx` cached) or
    "forward" (an encoder or classifier forward)."""
    try:
        with _meta_friendly():
            fwd, bwd, act, params = _count(cfg, mode, batch, seq, ctx, arch, dtype)
    except Exception as e:  # noqa: BLE001 - any model failure is a clear input error here
        raise WorkloadError(f"cannot run {type(cfg).__name__} on the meta device: "
                            f"{type(e).__name__}: {_first_line(e)}") from e
    return Workload(fwd, bwd, act, shape(cfg, int(params)))
