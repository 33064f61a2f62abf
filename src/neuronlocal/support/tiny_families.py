"""Per-family rules of tiny configs (support/tiny.py): what no general rule can express,
by model type, each applied to that level's config dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HEAD_DIM_TARGET = 16  # the per-head width tiny configs aim for


def _family_lfm2_moe(d: dict[str, Any]) -> None:
    """Its default config leaves layer_types unset (checkpoints mix conv and attention)."""
    if d.get("layer_types") is None:
        d["layer_types"] = ["conv"] * (d["num_hidden_layers"] - 1) + ["full_attention"]


def _family_qwen4_exp_text(d: dict[str, Any]) -> None:
    """Its default config leaves the sparse-attention indexer sizes unset."""
    fills = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
             "indexer_budget": 8, "indexer_compress_ratio": 4}
    d.update({k: v for k, v in fills.items() if d.get(k) is None})


def _family_cohere_compass_text(d: dict[str, Any]) -> None:
    """Its default config has no RoPE parameters for its layer types (the model needs them)."""
    if not d.get("rope_parameters"):
        half = (d.get("head_dim") or HEAD_DIM_TARGET) // 2
        section = [half - 2 * (half // 3), half // 3, half // 3]
        d["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": section}
                                for t in set(d.get("layer_types") or ["full_attention"])}


def _family_hrm_text(d: dict[str, Any]) -> None:
    """num_hidden_layers counts layers per stack x cycles; the per-stack count is derived."""
    d.pop("num_layers_per_stack", None)


def _family_dbrx(d: dict[str, Any]) -> None:
    """The attention sub-config reads rope_theta, which only the top level carries now, and
    clamps with clip_qkv, which its default leaves unset (DBRX checkpoints use 8)."""
    theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    attn = d.setdefault("attn_config", {})
    attn.setdefault("rope_theta", theta)
    if attn.get("clip_qkv") is None:
        attn["clip_qkv"] = 8.0


def _family_xlstm(d: dict[str, Any]) -> None:
    """Its config rounds qk/v widths up to multiples of 64 where the layers do not; a width
    of 128 makes both agree (as they do at every published size)."""
    d["hidden_size"] = d["embedding_dim"] = 128


def _family_reformer(d: dict[str, Any]) -> None:
    """Axial position embeddings must sum to the width and, in training, multiply to the
    sequence length (12, the matrix's); chunks divide it. Dropout off: its backward runs
    only in training mode (models.TRAIN_MODE_BACKWARD). LSH attention draws random
    rotations at every call; `hash_seed` fixes them, so CPU and neuron hash alike."""
    d["axial_pos_embds_dim"] = [d["hidden_size"] // 2, d["hidden_size"] // 2]
    d["axial_pos_shape"] = [3, 4]
    d["local_attn_chunk_length"] = d["lsh_attn_chunk_length"] = 4
    d["num_buckets"] = 4
    d["hash_seed"] = 0
    d["feed_forward_size"] = 128
    for key in list(d):
        if "dropout" in key and isinstance(d[key], float):
            d[key] = 0.0


def _family_dory(d: dict[str, Any]) -> None:
    """Its config.json lists attention and MLP blocks separately (two entries per layer)
    and splits layers into input, recurrent and output stacks that must add up: one input
    layer, a recurrent block with both attention kinds, one output layer."""
    d.update({"layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                              "full_attention"], "num_hidden_layers": 4, "n_input_layers": 1,
              "n_recurrent_layers": 2, "n_output_layers": 1})


def _family_cvt(d: dict[str, Any]) -> None:
    """Its stages index a drop-path list of length depth[stage] by stage number."""
    d["depth"] = [i + 1 for i in range(len(d["depth"]))]


def _family_efficientnet(d: dict[str, Any]) -> None:
    """Widths come from width_coefficient x the channel lists, rounded to multiples of
    depth_divisor, and hidden_dim must equal the rounded 1280: scale by the coefficient."""
    d["width_coefficient"], d["depth_coefficient"] = 0.25, 1.0
    d["hidden_dim"] = 320
    for key in ("in_channels", "out_channels"):
        d[key] = transformers_default(d, key)
    d.pop("num_hidden_layers", None)  # derived from the block repeats


def transformers_default(d: dict[str, Any], key: str) -> Any:
    """The value the family's config class has by default (undoing a general rule)."""
    from transformers import CONFIG_MAPPING

    return getattr(CONFIG_MAPPING[d["model_type"]](), key)


def _family_blt(d: dict[str, Any]) -> None:
    """Its model builds a DynamicCache from BltConfig, which has no num_hidden_layers in
    this transformers, so any forward with a cache fails upstream: run without one."""
    d["use_cache"] = False


# Rules no general rule can express, by model type (applied to that level's dict).
FAMILY_RULES: dict[str, Callable[[dict[str, Any]], None]] = {
    "lfm2_moe": _family_lfm2_moe, "qwen4_exp_text": _family_qwen4_exp_text,
    "cohere_compass_text": _family_cohere_compass_text, "hrm_text": _family_hrm_text,
    "dbrx": _family_dbrx, "reformer": _family_reformer, "xlstm": _family_xlstm,
    "blt": _family_blt, "dory": _family_dory, "cvt": _family_cvt,
    "efficientnet": _family_efficientnet,
}
