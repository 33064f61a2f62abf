"""Kernels where Trainium's device kernel accepts more than ATen's CPU kernel does.

Device code written for accelerators (CUDA, Neuron) uses dtypes the CPU kernels reject;
transformers' MoE routing, for one, calls `torch.histc` on int32 expert ids on every device
but cpu/mps. These run the CPU kernel in a dtype it supports and return the device's dtype.
"""

from __future__ import annotations

import torch

from neuronlocal import _C

_lib: torch.library.Library | None = None


def _histc(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    x = _C._cpu_alias(self)
    if self.is_floating_point():
        out = torch.histc(x, bins, min, max)
    else:  # CUDA semantics: integer histc counts in the input's dtype (exact below 2**24)
        out = torch.histc(x.double(), bins, min, max).to(self.dtype)
    return _C._bridge_out([out], self.device.index)[0]


def register() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("histc", _histc, "PrivateUse1")
