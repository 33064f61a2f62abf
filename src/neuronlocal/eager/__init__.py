"""Eager mode: policy and op data for the C++ CPU-alias dispatch (csrc/fallback.cpp)."""

from __future__ import annotations

import dataclasses

from neuronlocal import _C
from neuronlocal.core import state
from neuronlocal.core.config import PLACEMENTS, Config
from neuronlocal.eager import ops, overrides, rnn_cells


def register(cfg: Config) -> None:
    _C._set_policy(cfg.downcast_64bit, cfg.strict)
    _C._set_op_classes(*ops.op_classes())
    _set_placement(cfg.placement)
    _C._register_direct(ops.structured_ops() + ops.direct_composites())
    _C._register_tracked(ops.tracked_composites())
    _C._register_unsupported(list(ops.SPARSE_CONSTRUCTORS))
    overrides.register()
    rnn_cells.register()
    _print_on_host()


def add_device_kernel(name: str) -> None:
    """Make the custom op `name` a device op (an NKI kernel): tracked as executed, never as
    a CPU fallback, and not warned."""
    ops.add_device_kernel(name)
    if state.config.placement != "native":
        _C._set_op_placement(ops.decisions(), ops.OTHER_NAMESPACES)


def _set_placement(placement: str) -> None:
    if placement == "native":
        _C._set_op_placement({}, 0)
    else:
        _C._set_op_placement(ops.decisions(), ops.OTHER_NAMESPACES)


def set_policy(*, strict: bool | None = None, downcast_64bit: bool | None = None,
               placement: str | None = None) -> None:
    """Changes NEURONLOCAL_STRICT / NEURONLOCAL_DOWNCAST_64BIT / NEURONLOCAL_OP_PLACEMENT
    behaviour at run time."""
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
    cfg = state.config
    new = dataclasses.replace(
        cfg,
        strict=cfg.strict if strict is None else strict,
        downcast_64bit=cfg.downcast_64bit if downcast_64bit is None else downcast_64bit,
        placement=cfg.placement if placement is None else placement,
    )
    state.set_config(new)
    _C._set_policy(new.downcast_64bit, new.strict)
    if new.placement != cfg.placement:
        _set_placement(new.placement)


def _print_on_host() -> None:
    """Printing copies a neuron tensor to the host first, as reading a value does on
    Trainium (and as PyTorch does for xla/lazy/mtia), so formatting runs no device ops."""
    import torch._tensor_str as ts

    original = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "neuron":
            self = self.to("cpu")
        return original(self, indent)

    ts._tensor_str = _tensor_str
