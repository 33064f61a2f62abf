"""Kernels where Trainium's device kernel accepts more than ATen's CPU kernel does.

Device code written for accelerators (CUDA, Neuron) uses dtypes the CPU kernels reject;
transformers' MoE routing, for one, calls `torch.histc` on int32 expert ids on every device
but cpu/mps. These run the CPU kernel in a dtype it supports and return the device's dtype.
"""

from __future__ import annotations

import torch

from neuronlocal import _C

_lib: torch.library.Library | None = None


def histc_host(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
               ) -> torch.Tensor:
    """histc of a CPU tensor with device semantics: integer inputs count in their own dtype
    (as CUDA's kernel does; exact below 2**24). Compiled graphs call it too."""
    if x.is_floating_point():
        return torch.histc(x, bins, min, max)
    return torch.histc(x.double(), bins, min, max).to(x.dtype)


def _histc(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    out = histc_host(_C._cpu_alias(self), bins, min, max)
    return _C._bridge_out([out], self.device.index)[0]


def register() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("histc", _histc, "PrivateUse1")
