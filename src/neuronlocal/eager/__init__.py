"""Eager mode: policy for the C++ CPU-alias dispatch (see csrc/dispatch.cpp)."""

from __future__ import annotations

import dataclasses

from neuronlocal import _C
from neuronlocal.config import Config
from neuronlocal.eager import overrides
from neuronlocal.eager.ops import CPU_FALLBACK_OPS, structured_ops


def register(cfg: Config) -> None:
    _C._set_policy(cfg.downcast_64bit, cfg.strict)
    _C._set_cpu_fallback_ops(sorted(CPU_FALLBACK_OPS))
    _C._register_direct(structured_ops())
    overrides.register()
    _print_on_host()


def set_policy(*, strict: bool | None = None, downcast_64bit: bool | None = None) -> None:
    """Changes NEURONLOCAL_STRICT / NEURONLOCAL_DOWNCAST_64BIT behaviour at run time."""
    import neuronlocal

    cfg = neuronlocal.config
    cfg = dataclasses.replace(
        cfg,
        strict=cfg.strict if strict is None else strict,
        downcast_64bit=cfg.downcast_64bit if downcast_64bit is None else downcast_64bit,
    )
    neuronlocal.config = cfg
    _C._set_policy(cfg.downcast_64bit, cfg.strict)


def _print_on_host() -> None:
    """Printing copies a neuron tensor to the host first, as reading a value does on
    Trainium (and as PyTorch does for xla/lazy/mtia), so formatting runs no device ops."""
    import torch._tensor_str as ts

    original = ts._tensor_str

    def _tensor_str(self, indent):  # type: ignore[no-untyped-def]
        if self.device.type == "neuron":
            self = self.to("cpu")
        return original(self, indent)

    ts._tensor_str = _tensor_str
