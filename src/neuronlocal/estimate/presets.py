"""Published model shapes `neuronlocal estimate` and the calibration rows name (data).

Each preset is the model's published config.json (the fields that set its size, context
and positions), so an estimate of `qwen3-8b` is an estimate of Qwen/Qwen3-8B. `PUBLISHED`
gives the parameter count each model's card states, which a test checks the built preset
against.
"""

from __future__ import annotations

from typing import Any

# Llama 3.1 / 3.2 / 3.3 positions: RoPE base 500k, the "llama3" scaling of an 8k original.
_LLAMA3_ROPE = {"rope_theta": 500000.0, "max_position_embeddings": 131072}


def _llama3(factor: float) -> dict[str, Any]:
    return {**_LLAMA3_ROPE, "rope_scaling": {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


_QWEN3 = {"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936,
          "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
_QWEN3_MOE = {**_QWEN3, "model_type": "qwen3_moe", "num_experts": 128,
              "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "tie_word_embeddings": False}
# GPT-OSS: alternating 128-token sliding and full attention, YaRN positions to 131k.
_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128,
            "num_experts_per_tok": 4, "tie_word_embeddings": False, "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096}}
_MIXTRAL = {"model_type": "mixtral", "num_key_value_heads": 8, "num_experts_per_tok": 2,
            "num_local_experts": 8, "rope_theta": 1000000.0, "sliding_window": None}


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    return {**_GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)]}


PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096},
    "llama-2-13b": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                    "num_hidden_layers": 40, "num_attention_heads": 40,
                    "num_key_value_heads": 40, "vocab_size": 32000,
                    "max_position_embeddings": 4096},
    "llama-2-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "vocab_size": 32000,
                    "max_position_embeddings": 4096},
    "codellama-13b": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                      "num_hidden_layers": 40, "num_attention_heads": 40,
                      "num_key_value_heads": 40, "vocab_size": 32016,
                      "max_position_embeddings": 16384, "rope_theta": 1000000.0},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 128256, **_llama3(8.0)},
    "llama-3.1-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "vocab_size": 128256, **_llama3(8.0)},
    "llama-3.1-405b": {"model_type": "llama", "hidden_size": 16384,
                       "intermediate_size": 53248, "num_hidden_layers": 126,
                       "num_attention_heads": 128, "num_key_value_heads": 8,
                       "vocab_size": 128256, **_llama3(8.0)},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "tie_word_embeddings": True, **_llama3(32.0)},
    "llama-3.2-3b": {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "tie_word_embeddings": True, **_llama3(32.0)},
    # Mistral-7B v0.2 (the Instruct-v0.2 release): 32k positions, RoPE base 1e6, no
    # sliding window (v0.1 had an 8k context and a 4,096-token window).
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": None,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "mixtral-8x7b": {**_MIXTRAL, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
                     "max_position_embeddings": 32768},
    "mixtral-8x22b": {**_MIXTRAL, "hidden_size": 6144, "intermediate_size": 16384,
                      "num_hidden_layers": 56, "num_attention_heads": 48,
                      "vocab_size": 32768, "max_position_embeddings": 65536},
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 40, "num_attention_heads": 40,
                  "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4},
    "qwen3-235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4},
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "gpt3-175b": {"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96,
                  "n_positions": 2048, "vocab_size": 50257},
    "bert-base": {"model_type": "bert"},
    "bert-large": {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "intermediate_size": 4096},
    "roberta-base": {"model_type": "roberta", "vocab_size": 50265,
                     "max_position_embeddings": 514, "type_vocab_size": 1},
    "roberta-large": {"model_type": "roberta", "hidden_size": 1024, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "intermediate_size": 4096,
                      "vocab_size": 50265, "max_position_embeddings": 514,
                      "type_vocab_size": 1},
    "distilbert-base": {"model_type": "distilbert"},
    "vit-base": {"model_type": "vit", "image_size": 224, "patch_size": 16},
}
PRESETS["llama-3.3-70b"] = PRESETS["llama-3.1-70b"]

# Parameter counts the model cards publish (billions), for the presets of current models.
PUBLISHED: dict[str, float] = {
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.0,
    "llama-3.2-1b": 1.23, "llama-3.2-3b": 3.21, "llama-3.3-70b": 70.6,
    "mixtral-8x7b": 46.7, "mixtral-8x22b": 141.0,
    "qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8,
    "qwen3-32b": 32.8, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.0,
    "gpt-oss-20b": 21.0, "gpt-oss-120b": 117.0,
}
