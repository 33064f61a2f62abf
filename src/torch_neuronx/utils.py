"""TorchNeuron's `torch_neuronx.utils` helpers that read its build variables and instance
settings, answered from neuronlocal's configuration (`core/config.py`, `core/hardware.py`)."""

from __future__ import annotations

import torch

from neuronlocal.core import state as _state
from neuronlocal.core.config import env_flag

__all__ = [
    "get_lnc_setting", "get_logical_neuron_cores", "get_neuron_registered_ops",
    "get_platform_target", "is_sync_mode_enabled", "use_mlir_aten_ops",
]


def is_sync_mode_enabled() -> bool:
    """NEURON_LAUNCH_BLOCKING (1 in TorchNeuron's release builds)."""
    return env_flag("NEURON_LAUNCH_BLOCKING")


def use_mlir_aten_ops() -> bool:
    """TORCH_NEURONX_MLIR_ATEN_OPS (1 in TorchNeuron's release builds)."""
    return env_flag("TORCH_NEURONX_MLIR_ATEN_OPS")


def get_platform_target() -> str:
    """The instance family: `trn2` or `trn3`."""
    return _state.profile.instance.split(".")[0]


def get_lnc_setting() -> str:
    """The logical NeuronCore config in effect, as a string (`"1"` or `"2"`)."""
    return str(_state.profile.lnc)


def get_logical_neuron_cores() -> str:
    return get_lnc_setting()


def get_neuron_registered_ops(as_sorted: bool = False, keep_variant: bool = False
                              ) -> set[str] | list[str]:
    """Names of the ops with a kernel for the neuron device (PrivateUse1), read from the
    dispatcher as TorchNeuron's helper does: base names (`add`), or with their overload
    (`add.Tensor`) when keep_variant; a sorted list when as_sorted."""
    names = {reg.split("::", 1)[1] if keep_variant else reg.split("::", 1)[1].split(".")[0]
             for reg in torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1")
             if "::" in reg}
    return sorted(names) if as_sorted else names
