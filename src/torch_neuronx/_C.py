"""TorchNeuron's private binding names that its Python layer and code written for it call,
delegating to `torch.neuron` (neuronlocal's C++ core has its own bindings, `neuronlocal._C`)."""

from __future__ import annotations

from typing import Any

import torch

from neuronlocal import device as _neuron
from neuronlocal.eager import tracking as _tracking


def _neuron_init() -> None:
    _neuron.init()


def _is_neuron_runtime_initialized() -> bool:
    return bool(_neuron.is_initialized())


def _neuron_getDeviceCount() -> int:  # noqa: N802
    return _neuron.device_count()


def _vnc_count() -> int:
    """Logical cores this process sees (TorchNeuron's virtual NeuronCore count)."""
    return _neuron.device_count()


def _neuron_getCurrentDevice() -> int:  # noqa: N802
    return _neuron.current_device()


def _neuron_setDevice(device: int) -> None:  # noqa: N802
    _neuron.set_device(device)


def _neuron_getDeviceProperties(device: int) -> Any:  # noqa: N802
    return _neuron.get_device_properties(device)


def _neuron_synchronize(device: int = -1) -> None:
    _neuron.synchronize(None if device < 0 else device)


def _get_default_generator(device: int) -> torch.Generator:
    return _neuron._generator(device)


def _get_memory_stats(device: int) -> dict[str, Any]:
    return _neuron.memory_stats(device)


def _get_executed_ops() -> dict[str, int]:
    return _tracking.get_executed_ops()


def _get_fallback_ops() -> dict[str, int]:
    return _tracking.get_fallback_ops()


def _clear_op_tracking() -> None:
    _tracking.clear_op_tracking()
