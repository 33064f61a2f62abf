"""Tiny configs: a small random copy of any transformers config that still builds and runs.

A tiny copy must keep what makes the architecture what it is, or the check tests another
model. The rules, general first (a per-family rule only where no general rule can do it):

- The config is rebuilt through its own class from a shrunk dict, so transformers itself
  re-derives what depends on the sizes (head_dim from qk_rope_head_dim, layer_types from
  attention periods, ...) and validates the result.
- Widths, heads, experts and vocab are clamped small; widths that are a multiple or a
  fraction (1/2, 1/4) of the hidden size stay that multiple or fraction, so a width the
  model subtracts from the hidden size stays smaller than it. Per-head dims (rotary,
  latent and linear attention) scale with head_dim, so partial rotary and latent-attention
  splits stay consistent; full multi-head attention stays full (latent attention relies on
  it), grouped stays grouped; SSM heads x head dim keeps matching the inner width.
- Fields a default config leaves unset although the model needs them get their documented
  default (head_dim = hidden / heads, key-value heads = heads, top-k 2 for MoE); a
  vocabulary left to the checkpoint gets the tiny one.
- Depth: the shortest selection of layers that keeps one layer of each kind (attention,
  linear attention or SSM, dense or MoE MLP, per-layer overrides, KV-sharing). Per-layer
  lists, layer index lists, per_layer_config and "first k layers" counts are remapped to it;
  configs whose kinds follow periods keep the shortest prefix that holds every kind. A
  hybrid keeps at least one attention layer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeGuard

from neuronlocal.support.tiny_families import FAMILY_RULES, HEAD_DIM_TARGET

VOCAB = 256
MIN_LAYERS = 2

# Clamped to at most this value wherever the key appears (config or sub-config).
SIZES: dict[str, int] = {
    # widths
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "dim": 64,
    "word_embed_proj_dim": 64, "hidden_dim": 64, "projection_dim": 64, "d_embed": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64, "expert_intermediate_size": 64,
    "ffn_hidden_size": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "hidden_size_per_layer_input": 16,
    # depth of encoder-decoder stacks (decoder-only depth is chosen by layer kinds)
    "decoder_layers": 2, "encoder_layers": 2, "num_encoder_layers": 2, "num_decoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2, "n_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16, "attention_head_size": 16, "d_head": 16,
    # vocab and positions
    "vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "max_sequence_length": 128, "seq_length": 128, "vocab_size_per_layer_input": VOCAB,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "moe_k": 2,
    "moe_num_shared_experts": 1,
    # latent attention and low-rank projections
    "kv_lora_rank": 16, "q_lora_rank": 32,
    # convolutions / state spaces
    "state_size": 8, "ssm_state_size": 8, "conv_kernel": 4, "time_step_rank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mamba_d_state": 8,
    "mamba_n_heads": 4, "n_mamba_heads": 2, "mamba_num_heads": 4, "mamba_dt_rank": 8,
    "n_groups": 1, "mamba_n_groups": 1, "mamba_ngroups": 1, "chunk_size": 64,
    "mamba_chunk_size": 64,
    "sliding_window": 32, "attention_chunk_size": 32, "num_memory_tokens": 0,
    "index_topk": 8, "index_n_heads": 2, "d_latents": 64, "num_latents": 16,
    "num_filters": 8, "image_size": 64, "num_self_attends_per_block": 1,
}
# Clamps by name for keys the table does not list: (substring, limit), first match wins.
_NAME_LIMITS = (("per_tok", 2), ("topk", 2), ("top_k", 2), ("expert_group", 1),
                ("kv_heads", 2), ("key_value_heads", 2), ("_heads", 4))
# Dims measured per attention head: scaled by head_dim's factor, so sums and ratios
# between them (qk_head_dim = nope + rope, partial rotary) survive the shrink.
HEAD_DIM_SUFFIXES = ("head_dim", "_headdim", "_d_head", "rotary_dim", "rotary_emb_dim")
# Widths that are a fixed multiple of the hidden size stay that multiple.
_HIDDEN_RATIOS = (0.25, 0.5, 1, 2, 3, 4, 8)
_WIDTH_WORDS = ("hidden", "size", "dim", "width", "inner", "ffn", "intermediate", "embed",
                "channels")
# Large leftovers (not in SIZES, not a hidden multiple) clamped by what their name says.
_LARGE_LIMITS = (("vocab", VOCAB), ("expert", 4), ("ffn", 128), ("intermediate", 128),
                 ("hidden", 64), ("inner", 128), ("_dim", 64), ("embed", 64), ("rank", 16),
                 ("_size", 64))
_EXPANDS = ("mamba_expand", "expand")
# Per-stage lists of vision and audio backbones: depths become 1 per stage, widths shrink
# by one factor per config level (so a stage's output still equals the next one's input),
# heads per stage at most 2 (widths stay multiples of 4, so they divide).
_STAGE_DEPTHS = ("depths", "depth", "stage_depths", "num_block_repeats", "block_repeats",
                 "num_layers", "layers", "num_blocks", "repeats", "num_stacks")
_STAGE_WIDTHS = ("hidden_size", "hidden_sizes", "embed_dim", "embed_dims", "dims", "channels",
                 "filters", "widths", "neck_hidden_sizes", "hidden_dims", "stem_channels",
                 "stage_in_channels", "stage_out_channels", "stage_mid_channels")
_STAGE_HEADS = ("num_heads", "num_attention_heads", "heads", "attention_heads")
_STAGE_WIDTH = 64
_DERIVED_STAGES = ("out_features", "out_indices", "stage_names")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
             "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks")
# "The first k layers are dense" style counts, and "the last k layers share a KV cache".
_FIRST_K = ("first_k_dense_replace", "num_dense_layers", "first_dense_layers")
_LAST_K = ("num_kv_shared_layers",)
_NOT_LAYER_LISTS = ("architectures", "per_layer_config", "rope_parameters")
_LINEAR_KINDS = {"linear_attention", "mamba", "conv", "recurrent"}


# Families whose layers of one kind share weights: keep two layers of each kind.
TWO_PER_KIND = ("zamba",)


class Options(NamedTuple):
    vocab: int = VOCAB
    min_layers: int = MIN_LAYERS  # homogeneous stacks keep this many layers
    prefix: bool = False  # keep a prefix of the layers rather than a selection


DEFAULT = Options()


def shrink(config: Any, min_layers: int = MIN_LAYERS) -> Any:
    """A tiny copy of `config` built by its own class (see the module docstring)."""
    from neuronlocal.support.configs import build_config

    old = config.to_dict()
    record: list[_Selection] = []
    new = shrink_dict(old, config, Options(min_layers=min_layers), record=record)
    _follow_widths(old, new)
    try:
        cfg, _ = build_config(type(config), new)
        if _kinds_survive(config, cfg, record):
            return cfg
    except Exception:  # noqa: BLE001 - the prefix below is the safe fallback
        pass
    # Kinds the config derives (from periods, from positions) did not survive a selection of
    # layers: keep the shortest prefix that holds every kind instead.
    new = shrink_dict(old, config, Options(min_layers=min_layers, prefix=True))
    _follow_widths(old, new)
    return build_config(type(config), new)[0]


_Selection = tuple[tuple[str, ...], int, list[int]]  # config path, layers before, kept ones


def _walk(config: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        config = getattr(config, key, None)
    return config


@functools.cache
def _base_properties() -> frozenset[str]:
    """Properties every transformers config has (`torch_dtype`, `use_return_dict`, ...):
    none is per layer, and reading the deprecated ones logs a deprecation warning."""
    from transformers import PretrainedConfig

    return frozenset(k for k, v in vars(PretrainedConfig).items() if isinstance(v, property))


def _attributes(config: Any, skip: Any = ()) -> Iterator[tuple[str, Any]]:
    """(name, value) of a config's public attributes and model-specific properties."""
    base = _base_properties()
    for name in dir(config):
        if name.startswith("_") or name in base or name in skip:
            continue
        try:
            yield name, getattr(config, name)
        except Exception:  # noqa: BLE001 - properties may raise on partial configs
            continue


def _derived_lists(config: Any, n: int) -> dict[str, list[Any]]:
    return {name: list(value) for name, value in _attributes(config, ("per_layer_config",))
            if isinstance(value, (list, tuple)) and len(value) == n}


def _kinds_survive(old_cfg: Any, new_cfg: Any, record: list[_Selection]) -> bool:
    """Every per-layer list the old config exposes reads, on the new one, as the kept rows
    (up to shrunk values)."""
    for path, n, sel in record:
        before, after = _walk(old_cfg, path), _walk(new_cfg, path)
        if before is None or after is None or sel == list(range(len(sel))):
            continue
        for name, values in _derived_lists(before, n).items():
            if not _same_pattern(list(getattr(after, name, None) or []),
                                 [values[i] for i in sel]):
                return False
    return True


def _same_pattern(a: list[Any], b: list[Any]) -> bool:
    """Equal length and equal where the other is equal (sizes are shrunk, kinds are not)."""
    return len(a) == len(b) and all((a[i] == a[j]) == (b[i] == b[j])
                                    for i in range(len(a)) for j in range(i))


def shrink_dict(d: dict[str, Any], config: Any | None, opts: Options = DEFAULT,
                record: list[_Selection] | None = None, path: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    """The shrunk dict of one config level; sub-config dicts are shrunk recursively.
    `record` collects the layer selections made, for `_kinds_survive`."""
    old = dict(d)
    out = dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            out[key] = shrink_dict(value, getattr(config, key, None), opts, record,
                                   (*path, key))
    _fill_unset(out)
    _no_layer_drop(out)
    old.update({k: v for k, v in out.items() if old.get(k) is None and v is not None})
    _clamp_sizes(old, out)
    _scale_head_dims(old, out)
    _keep_products(old, out)
    _fix_heads(old, out)
    _fix_token_ids(out, int(out.get("vocab_size") or opts.vocab))
    _shrink_stages(old, out)
    sel = _select_layers(old, out, config, opts)
    depth = _depth_key(old)
    if sel is not None and record is not None and depth is not None:
        record.append((path, old[depth], sel))
    if "use_cache" in out:
        out["use_cache"] = True
    rule = FAMILY_RULES.get(str(out.get("model_type")))
    if rule is not None:
        rule(out)
    return out


_Pair = tuple[dict[str, Any], dict[str, Any]]


def _levels(old: dict[str, Any], new: dict[str, Any]) -> list[_Pair]:
    """(old, new) dicts of every config level, sub-configs included."""
    out = [(old, new)]
    for key, value in old.items():
        if isinstance(value, dict) and "model_type" in value and isinstance(new.get(key), dict):
            out += _levels(value, new[key])
    return out


def _follow_widths(old: dict[str, Any], new: dict[str, Any]) -> None:
    """A width named after another part of the model (hidden_size_global, text_hidden_size)
    keeps equalling that part's hidden size."""
    levels = _levels(old, new)
    widths: dict[int, set[int]] = {}
    for o, n in levels:
        if _int(o.get("hidden_size")) and _int(n.get("hidden_size")):
            widths.setdefault(o["hidden_size"], set()).add(n["hidden_size"])
    for o, n in levels:
        for key, value in o.items():
            if (key != "hidden_size" and "hidden" in key and _int(value)
                    and len(widths.get(value, ())) == 1 and value != o.get("hidden_size")):
                n[key] = next(iter(widths[value]))


def _int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _fill_unset(d: dict[str, Any]) -> None:
    """Documented defaults for fields a default config leaves unset but the model reads."""
    if "vocab_size" in d and d["vocab_size"] is None:  # ESM: each checkpoint sets both
        d["vocab_size"] = VOCAB
        if "pad_token_id" in d and d["pad_token_id"] is None:
            d["pad_token_id"] = 1  # below the ids the inputs draw (3 and up)
    heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
    if "head_dim" in d and d["head_dim"] is None and _int(heads) and _int(hidden) and heads:
        d["head_dim"] = hidden // heads
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and _int(heads):
        d["num_key_value_heads"] = heads
    if _int(d.get("moe_intermediate_size")):
        for key, value in (("n_routed_experts", 4), ("num_experts", 4), ("n_shared_experts", 1),
                           ("num_experts_per_tok", 2)):
            if key in d and d[key] is None:
                d[key] = value
    if d.get("num_experts_per_tok", 0) is None and any(
            _int(d.get(k)) and d[k] > 1 for k in ("n_routed_experts", "num_experts",
                                                   "num_local_experts")):
        d["num_experts_per_tok"] = 2


def _no_layer_drop(d: dict[str, Any]) -> None:
    """LayerDrop off: it skips layers on `torch.rand([])` draws from the CPU generator, which
    dropout on CPU also draws from and dropout on neuron does not, so the two sides of a
    training step would skip different layers (as they would on Trainium)."""
    for key, value in d.items():
        if "layerdrop" in key and isinstance(value, (int, float)) and value:
            d[key] = 0.0


def _is_head_dim(key: str) -> bool:
    return key != "head_dim" and key.endswith(HEAD_DIM_SUFFIXES)


def _hidden_key(d: dict[str, Any]) -> str | None:
    return next((k for k in ("hidden_size", "d_model", "n_embd") if _int(d.get(k))), None)


def _clamp_sizes(old: dict[str, Any], d: dict[str, Any]) -> None:
    for key, value in old.items():
        if isinstance(value, list) and value and all(_int(v) for v in value) \
                and _int(SIZES.get(key)):
            d[key] = [min(v, SIZES[key]) for v in value]  # per-layer sizes
            continue
        if not _int(value) or key in _DEPTH_KEYS:
            continue  # depth is chosen by _select_layers
        limit = SIZES.get(key)
        if limit is None and not _is_head_dim(key):
            limit = next((lim for part, lim in _NAME_LIMITS if part in key), None)
        if limit is not None:
            d[key] = min(value, limit)
    hidden = _hidden_key(old)
    for key, value in old.items():
        if (not _int(value) or key in SIZES or _is_head_dim(key)
                or "token" in key or "position" in key or "max_" in key or "seed" in key
                or "chunk" in key):
            continue
        ratio = value / old[hidden] if hidden else 0
        if hidden and ratio in _HIDDEN_RATIOS and (value > 256 or ratio < 1) and any(
                part in key for part in _WIDTH_WORDS):
            # however small: MobileBERT's head is `hidden - embedding_size` wide
            d[key] = int(d[hidden] * ratio)
            continue
        if value <= 256:
            continue
        limit = next((lim for part, lim in _LARGE_LIMITS if part in key), None)
        if limit is not None:
            d[key] = limit


def _head_dim_of(d: dict[str, Any]) -> int | None:
    if _int(d.get("head_dim")) and d["head_dim"] > 0:
        return d["head_dim"]
    for width, heads in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"),
                         ("d_model", "num_heads"), ("hidden_size", "n_heads")):
        if _int(d.get(width)) and _int(d.get(heads)) and d[heads] > 0:
            return d[width] // d[heads]
    return None


def _scale_head_dims(old: dict[str, Any], d: dict[str, Any]) -> None:
    """Per-head dims shrink by head_dim's factor (at least 2, kept even for rotary halves)."""
    before, after = _head_dim_of(old), _head_dim_of(d)
    if not before or not after:  # no attention width: the largest per-head dim sets the scale
        before = max((v for k, v in old.items() if _is_head_dim(k) and _int(v)), default=0)
        after = HEAD_DIM_TARGET
    factor = before / after if before > after else 1.0
    for key, v in old.items():
        if _is_head_dim(key) and _int(v) and v > 0:
            d[key] = max(2, int(round(v / factor / 2)) * 2)


def _keep_products(old: dict[str, Any], d: dict[str, Any]) -> None:
    """SSM heads x head dim == inner width (expand x hidden, or mamba_d_ssm) keeps holding."""
    hidden = _hidden_key(old)
    expand = next((old[e] for e in _EXPANDS if isinstance(old.get(e), (int, float))
                   and not isinstance(old.get(e), bool)), None)
    if hidden is None:
        return
    targets = []
    if _int(old.get("mamba_d_ssm")) and _int(d.get("mamba_d_ssm")):
        targets.append((old["mamba_d_ssm"], d["mamba_d_ssm"]))
    if expand is not None:
        targets.append((int(old[hidden] * expand), int(d[hidden] * expand)))
    ssm = any("mamba" in k for k in old)  # hybrids name SSM sizes mamba_*; pure SSMs do not
    counts = [k for k in old if _int(old[k]) and k.endswith("heads") and ("mamba" in k or not ssm)]
    dims = [k for k in old if _int(old[k]) and (_is_head_dim(k) or k == "head_dim")
            and ("mamba" in k or not ssm)]
    for before, after in targets:
        for c in counts:
            for dim in dims:
                if old[c] * old[dim] == before and d[c] > 0 and after % d[c] == 0:
                    d[dim] = after // d[c]


def _fix_heads(old: dict[str, Any], d: dict[str, Any]) -> None:
    """Grouped-query stays grouped and full multi-head stays full (latent attention needs it)."""
    for heads_key, kv_keys in (("num_attention_heads", ("num_key_value_heads", "num_kv_heads")),
                               ("n_head", ("n_kv_heads",)), ("num_heads", ("num_kv_heads",))):
        heads = d.get(heads_key)
        for kv_key in kv_keys:
            kv = d.get(kv_key)
            if not (_int(heads) and _int(kv) and kv > 0):
                continue
            if old.get(kv_key) == old.get(heads_key):
                d[kv_key] = heads
            elif heads % kv:
                d[kv_key] = 1


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_int(x) for x in v)


def _shrink_stages(old: dict[str, Any], d: dict[str, Any]) -> None:
    """Per-stage lists of backbones (see _STAGE_DEPTHS); image sides at most 64."""
    widths = [k for k, v in old.items() if _int_list(v) and (
        k in _STAGE_WIDTHS or k.endswith(("_channels", "_sizes", "_dims")))
        and not any(w in k for w in ("patch", "kernel", "stride", "padding", "pool", "window"))]
    top = max((max(old[k]) for k in widths), default=0)
    factor = top / _STAGE_WIDTH if top > _STAGE_WIDTH else 1.0
    for k in widths:
        d[k] = [max(4, int(round(v / factor / 4)) * 4) if v >= 4 else v for v in old[k]]
    for k, v in old.items():  # a stem feeding the first stage scales with the stages
        if widths and _int(v) and v >= 4 and k.endswith("_channels") and "num_" not in k:
            d[k] = max(4, int(round(v / factor / 4)) * 4)
    staged = any(_int_list(old.get(k)) for k in _STAGE_DEPTHS)
    if staged and _int(old.get("embed_dim")):
        d["embed_dim"] = min(old["embed_dim"], 16)  # stage widths grow from it (x2 per stage)
    for k, v in old.items():
        if _int_list(v) and k in _STAGE_DEPTHS:
            d[k] = [min(x, 1) for x in v]
        elif _int_list(v) and k in _STAGE_HEADS:
            d[k] = [min(x, 2) for x in v]
        elif k in ("image_size", "input_size") and _int_list(v):
            d[k] = [min(x, 64) for x in v]
        elif k == "num_groups" and _int(v) and widths:
            d[k] = min(v, 4)  # group norms over widths that are multiples of 4
    if ("image_size" in old or "num_channels" in old) and _int(old.get("window_size")):
        d["window_size"] = min(old["window_size"], 2)  # divides every feature map of 64 px
    for k in _DERIVED_STAGES:
        if k in d and isinstance(d[k], list):
            d[k] = None  # re-derived by the class from the new depth


def _fix_token_ids(d: dict[str, Any], vocab: int) -> None:
    """Token ids inside the shrunk vocabulary; encoder-decoders get a decoder start token."""
    if d.get("is_encoder_decoder") and d.get("pad_token_id") is None:
        d["pad_token_id"] = 0  # labels are shifted right with it
    if d.get("is_encoder_decoder") and d.get("decoder_start_token_id") is None:
        d["decoder_start_token_id"] = d["pad_token_id"]  # T5's convention
    for key in [k for k in d if k in TOKEN_IDS or k.endswith(("token_id", "token_index"))]:
        tid = d.get(key)
        if _int(tid) and tid >= vocab:
            d[key] = vocab - 1
        elif isinstance(tid, list):
            d[key] = [t if not _int(t) or t < vocab else vocab - 1 for t in tid]


def _is_index_key(key: str) -> bool:
    return any(s in key for s in ("idx", "ids", "indices", "layers", "index"))


def _per_layer_lists(old: dict[str, Any], n: int) -> dict[str, list[Any]]:
    """Serialised per-layer lists (kinds per layer), index lists turned into flags."""
    out = {}
    for key, value in old.items():
        if key in _NOT_LAYER_LISTS or not isinstance(value, list):
            continue
        if _index_list(key, value, n):
            out[key] = [i in set(value) for i in range(n)]
        elif len(value) == n and all(isinstance(x, (str, bool, int, float, type(None)))
                                     for x in value):
            out[key] = list(value)
    return out


def _index_list(key: str, value: list[Any], n: int) -> bool:
    """A list of layer indices (`moe_layers`, `full_attn_idxs`), as opposed to one value per
    layer: an index-named key holding increasing indices below n. One that names every layer
    has n entries too, and read as values it would make each layer a kind of its own."""
    return bool(value) and _is_index_key(key) and all(_int(x) and 0 <= x < n for x in value) \
        and all(a < b for a, b in zip(value, value[1:], strict=False))


def _layer_kinds(old: dict[str, Any], config: Any | None, n: int
                 ) -> tuple[list[tuple[Any, ...]], bool]:
    """The kind of each of n layers, and whether kinds follow periods (keep a prefix)."""
    vectors = list(_per_layer_lists(old, n).values())
    for key in _FIRST_K:
        if _int(old.get(key)) and 0 < old[key] <= n:
            vectors.append([i < old[key] for i in range(n)])
    for key in _LAST_K:
        if _int(old.get(key)) and 0 < old[key] <= n:
            vectors.append([i >= n - old[key] for i in range(n)])
    for start, end in _ranges(old, n):
        vectors.append([old[start] <= i <= old[end] for i in range(n)])
    overrides = {int(k): v for k, v in (old.get("per_layer_config") or {}).items()}
    if overrides:
        vectors.append([repr(sorted(overrides.get(i, {}).items())) for i in range(n)])
    if config is not None:  # kinds only the config object knows (properties from periods)
        for _, value in _attributes(config, {*old, *_NOT_LAYER_LISTS}):
            if isinstance(value, (list, tuple)) and len(value) == n and n > 1 and all(
                    isinstance(x, (str, bool, int, type(None))) for x in value):
                vectors.append(list(value))
    periodic = any(_int(v) and v > 1 and ("period" in k or k.endswith(("_freq", "_step")))
                   for k, v in old.items())
    return [tuple(v[i] for v in vectors) for i in range(n)], periodic


def _ranges(old: dict[str, Any], n: int) -> list[tuple[str, str]]:
    """(X_start_index, X_end_index) pairs: layers start..end (inclusive) are of one kind."""
    out = []
    for key, value in old.items():
        if key.endswith("_start_index") and _int(value):
            end = key[: -len("_start_index")] + "_end_index"
            if _int(old.get(end)) and 0 <= value <= old[end] < n:
                out.append((key, end))
    return out


def _depth_key(d: dict[str, Any]) -> str | None:
    return next((k for k in _DEPTH_KEYS if _int(d.get(k))), None)


def _select_layers(old: dict[str, Any], d: dict[str, Any], config: Any | None,
                   opts: Options) -> list[int] | None:
    """Chooses the layers to keep and remaps per-layer fields; the kept indices."""
    key = _depth_key(old)
    if key is None:
        return None
    n = old[key]
    kinds, periodic = _layer_kinds(old, config, n)
    prefix = opts.prefix or periodic
    per_kind = 2 if old.get("model_type") in TWO_PER_KIND else 1
    seen: dict[tuple[Any, ...], int] = {}
    sel = []
    for i, kind in enumerate(kinds):
        if seen.get(kind, 0) < per_kind:
            seen[kind] = seen.get(kind, 0) + 1
            sel.append(i)
    if len(sel) < opts.min_layers:
        sel = sorted(set(sel) | set(range(min(opts.min_layers, n))))
    if prefix:
        sel = list(range(max(sel) + 1))
    for k in _DEPTH_KEYS:
        if old.get(k) == n:
            d[k] = len(sel)
    _remap_layer_fields(old, d, n, sel)
    for k, v in old.items():  # a hybrid whose default config has no attention layer gets one
        if v is None and "attn" in k and _is_index_key(k) and "dropout" not in k:
            d[k] = [len(sel) - 1]
    types = d.get("layer_types")
    if isinstance(types, list) and types and set(types) == {"linear_attention"}:
        d["layer_types"] = types[:-1] + ["full_attention"]
    return sel


def _remap_layer_fields(old: dict[str, Any], d: dict[str, Any], n: int, sel: list[int]) -> None:
    for key, value in old.items():
        if key in _NOT_LAYER_LISTS or not isinstance(value, list):
            continue
        if _index_list(key, value, n):
            d[key] = [j for j, i in enumerate(sel) if i in set(value)]
        elif len(value) == n:
            cur = d.get(key)
            src = cur if isinstance(cur, list) and len(cur) == n else value  # clamped sizes
            d[key] = [src[i] for i in sel]
    for key in _FIRST_K:
        if _int(old.get(key)) and 0 < old[key] <= n:
            d[key] = sum(1 for i in sel if i < old[key])
    for key in _LAST_K:
        if _int(old.get(key)) and 0 < old[key] <= n:
            d[key] = sum(1 for i in sel if i >= n - old[key])
    for start, end in _ranges(old, n):
        inside = [j for j, i in enumerate(sel) if old[start] <= i <= old[end]]
        if inside:
            d[start], d[end] = inside[0], inside[-1]
    overrides = {int(k): v for k, v in (old.get("per_layer_config") or {}).items()}
    if overrides:
        d["per_layer_config"] = {str(j): _scale_overrides(overrides[i], old, d)
                                 for j, i in enumerate(sel) if i in overrides}


def _scale_overrides(over: dict[str, Any], old: dict[str, Any], d: dict[str, Any]
                     ) -> dict[str, Any]:
    """A layer's overrides keep their ratio to the (shrunk) global value."""
    out = dict(over)
    for key, value in over.items():
        if _int(value) and _int(old.get(key)) and old[key] > 0 and _int(d.get(key)):
            out[key] = max(1, int(round(d[key] * value / old[key])))
    return out
