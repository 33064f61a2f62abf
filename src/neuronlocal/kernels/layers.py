"""Layers the HF `kernels` library swaps into transformers models on neuron.

`kernels` replaces a layer's `forward` with one of these (the instance keeps its weights),
so each class is stateless and its `forward` has the signature of the layer it replaces.
They are exported by the local layer repository `hub_repo/` (see hub.py).
"""

from __future__ import annotations

import torch
from torch import nn

from neuronlocal.kernels.library import apply_rotary, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    """Replaces `RMSNorm` (LlamaRMSNorm and its copies): one fused host call."""

    can_torch_compile = True
    has_backward = True
    weight: torch.Tensor  # the attributes of the layer it replaces
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class RotaryEmbedding(nn.Module):
    """Replaces the `rotary_pos_emb` function (apply_rotary_pos_emb): q and k in one call."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary(q, k, cos, sin, unsqueeze_dim)


class SwiGLUMLP(nn.Module):
    """Replaces a gated MLP (gate_proj, up_proj, down_proj, SiLU): silu(gate)*up fused."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
