"""torch.neuron.amp: the names torch.cuda.amp has, for code ported from CUDA.

`torch.neuron.amp.autocast(...)` is `torch.autocast("neuron", ...)`, `GradScaler(...)` is
`torch.amp.GradScaler("neuron", ...)`, and `custom_fwd` / `custom_bwd` are torch.amp's with
`device_type="neuron"`. Registered as `torch.neuron.amp` by `neuronlocal/__init__.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]


class autocast(torch.amp.autocast):  # noqa: N801  (torch.cuda.amp's spelling)
    """`torch.autocast("neuron")`; `dtype=None` is `torch.get_autocast_dtype("neuron")`."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype | None = None,
                 cache_enabled: bool = True) -> None:
        super().__init__("neuron", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler("neuron")` with torch.cuda.amp.GradScaler's arguments."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        super().__init__("neuron", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


custom_fwd: Any = functools.partial(torch.amp.custom_fwd, device_type="neuron")
custom_bwd: Any = functools.partial(torch.amp.custom_bwd, device_type="neuron")


def hops_fall_through_autocast() -> None:
    """Higher-order operators (FlexAttention's backward, torch.cond, ...) under
    `torch.autocast("neuron")`: PyTorch lets them fall through the autocast keys of CPU, CUDA
    and XPU (the ops of their bodies autocast themselves) but not PrivateUse1's, so one
    without an autocast kernel of its own found no kernel. Neuron's key falls through the
    same way, for the operators that exist now and those made later."""
    from torch import _ops

    key = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]
    if key not in _ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS:
        _ops._HIGHER_ORDER_OP_DEFAULT_FALLTHROUGH_DISPATCH_KEYS.append(key)
    for hop in list(_ops._higher_order_ops.values()):
        if key not in hop.py_kernels:
            hop.fallthrough(key)
