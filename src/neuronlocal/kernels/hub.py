"""HF `kernels` on neuron: a local layer repository mapping, no Hub download.

`kernels` picks the `neuron` backend when `torch.neuron` exists and looks layers up per
device type. On Trainium the mapping points at Hub repos with NKI builds; here it points at
`hub_repo/`, a local repository inside this package whose `torch-neuron` variant exports the
layers of `layers.py`. `register()` installs that mapping for device `neuron` (and makes
transformers' gated MLPs kernelizable under the name `LlamaMLP`); `kernelize()` runs
`kernels.kernelize` with it and switches attention to the `neuron` attention kernel;
`kernel_config()` gives the transformers `KernelConfig` for `use_kernels=True`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from neuronlocal.kernels.library import attention

__all__ = ["LAYERS", "REPO_PATH", "func_key", "kernel_config", "kernel_mapping", "kernelize",
           "register"]

REPO_PATH = Path(__file__).parent / "hub_repo"
# transformers layer name -> layer class in hub_repo
LAYERS = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "RotaryEmbedding", "LlamaMLP": "SwiGLUMLP"}
ATTENTION = "neuron"
_registered = False

_MISSING = ("the HF `kernels` package is not installed; install it with "
            "`pip install -c constraints.txt kernels` (it must not replace torch)")


def _kernels() -> Any:
    try:
        import kernels
    except ImportError as e:
        raise ImportError(f"neuronlocal.kernels.hub: {_MISSING}.") from e
    return kernels


def kernel_mapping() -> dict[str, dict[str, Any]]:
    """{layer name: {"neuron": LocalLayerRepository}} for `kernels.register_kernel_mapping`."""
    k = _kernels()
    return {name: {"neuron": k.LocalLayerRepository(REPO_PATH, layer_name=layer)}
            for name, layer in LAYERS.items()}


def _gated_silu(module: nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    names = ("gate_proj", "up_proj", "down_proj")
    return act in ("silu", "swish") and all(
        isinstance(getattr(module, n, None), nn.Linear) for n in names
    )


def neuron_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function `neuron`: one host call (GQA without repeat_kv)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (dropout and module.training) or kwargs.get("position_bias") is not None \
            or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    lq = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and lq > 1)
    if causal and key.shape[2] > lq:
        key, value = key[:, :, :lq], value[:, :, :lq]
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]
    out = attention(query, key, value, attention_mask, scaling, causal)
    return out.transpose(1, 2).contiguous(), None


def _mark_transformers_layers(k: Any) -> None:
    """Make Llama's layers kernelizable where transformers' own decorators did not.

    transformers only applies `use_kernel_forward_from_hub` when its pinned `kernels` range is
    installed (5.24 wants >=0.18.2); with another version its decorators are no-ops, so the
    same marks are applied here: RMSNorm, the rotary function, and the gated MLP.
    """
    from transformers.models.llama import modeling_llama as ml

    if not hasattr(ml.LlamaRMSNorm, "kernel_layer_name"):
        k.replace_kernel_forward_from_hub(ml.LlamaRMSNorm, "RMSNorm")
    if not hasattr(ml.apply_rotary_pos_emb, "kernel_layer_name"):
        ml.apply_rotary_pos_emb = k.use_kernel_forward_from_hub("rotary_pos_emb")(
            ml.apply_rotary_pos_emb)
        k.use_kernelized_func(ml.apply_rotary_pos_emb)(ml.LlamaAttention)
    if not hasattr(ml.LlamaMLP, "kernel_layer_name"):
        k.replace_kernel_forward_from_hub(ml.LlamaMLP, "LlamaMLP", condition=_gated_silu)


_DIGEST_MISSING = "does not record a digest"
_DIGEST_MEANING = (" (kernels loads its files unverified: nothing checks they were not changed "
                   "after the build; neuronlocal's own kernel repository is part of the "
                   "installed package. Shown once per process.)")


class _DigestOnce(logging.Filter):
    """kernels warns about a missing digest at every load (three per model); once, with its
    meaning, is enough."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if _DIGEST_MISSING not in str(record.msg):
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = record.getMessage() + _DIGEST_MEANING, None
        return True


DIGEST_FILTER = _DigestOnce()


def register() -> None:
    """Install the neuron mapping in `kernels` and the `neuron` attention in transformers."""
    global _registered
    if _registered:
        return
    k = _kernels()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    logger = logging.getLogger("kernels._internals.validate")
    if DIGEST_FILTER not in logger.filters:
        logger.addFilter(DIGEST_FILTER)
    _mark_transformers_layers(k)
    k.register_kernel_mapping(kernel_mapping())
    AttentionInterface.register(ATTENTION, neuron_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    _registered = True


def func_key(fn: Any) -> str:
    """The key `kernels` files a kernelized function under in a module's `_kernel_funcs`.

    kernels 0.19 turns a decorated function into a module instance (no `__name__`, so the
    layer name); older releases keep the function and its `__name__`.
    """
    return str(getattr(fn, "__name__", None) or fn.kernel_layer_name)


def attach_funcs(model: nn.Module) -> None:
    """Attention modules built before `register()` get the rotary function attached now."""
    from transformers.models.llama import modeling_llama as ml

    fn = ml.apply_rotary_pos_emb
    for module in model.modules():
        if isinstance(module, ml.LlamaAttention) and "_kernel_funcs" not in module.__dict__:
            module.__dict__["_kernel_funcs"] = {func_key(fn): type(fn)() if isinstance(
                fn, nn.Module) else fn}


def kernelize(
    model: nn.Module, *, device: str = "neuron", mode: Any = None, attention: bool = True,
) -> nn.Module:
    """Swap a transformers model's layers for neuronlocal's kernels (in place; returns it).

    `mode` is a `kernels.Mode`; by default INFERENCE or TRAINING from `model.training`.
    With `attention=True` the model's attention runs through the `neuron` attention kernel.
    """
    if device != "neuron":
        raise ValueError(f"neuronlocal.kernels.kernelize(device={device!r}): this mapping is "
                         "for device 'neuron'; call kernels.kernelize directly for others.")
    k = _kernels()
    register()
    attach_funcs(model)
    if mode is None:
        mode = k.Mode.TRAINING if model.training else k.Mode.INFERENCE
    k.kernelize(model, device=device, mode=mode, use_fallback=True)
    set_attention = getattr(model, "set_attn_implementation", None)
    if attention and callable(set_attention):
        set_attention(ATTENTION)
    return model


def kernel_config() -> Any:
    """transformers `KernelConfig` mapping each layer to the local repository for `neuron`.

    Use with `from_pretrained(..., use_kernels=True, kernel_config=kernel_config(),
    device_map="neuron", attn_implementation="neuron")`.
    """
    register()
    from transformers import KernelConfig

    return KernelConfig({name: {"neuron": f"{REPO_PATH}:{layer}"} for name, layer in
                         LAYERS.items()}, use_local_kernel=True)
