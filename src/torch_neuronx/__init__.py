"""Compatibility package: the names TorchNeuron's `torch_neuronx` exposes, backed by neuronlocal.

Every public name of TorchNeuron's package is here and delegates to `torch.neuron`
(`neuronlocal.device`), so code written against `torch_neuronx.device_count()`,
`torch_neuronx.current_stream()` or `torch_neuronx.Stream` runs unchanged. Importing it sets
TorchNeuron's build variables to their release values (a value already set wins), as
TorchNeuron's own import does. Its presence is also what transformers and accelerate look
for (`importlib.util.find_spec("torch_neuronx")`) before checking `torch.neuron.is_available()`.
"""

from __future__ import annotations

import os

# TorchNeuron's release build values; set before anything reads them.
for _name, _value in (("NEURON_LAUNCH_BLOCKING", "1"),
                      ("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "0"),
                      ("TORCH_NEURONX_MLIR_ATEN_OPS", "1"),
                      ("TORCH_NEURONX_RETAIN_DEVICE_MODE", "0")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

import neuronlocal  # noqa: E402
from neuronlocal import device as neuron  # noqa: E402  (the torch.neuron module)
from neuronlocal.core.dynamo_metrics import get_dynamo_metrics, reset_dynamo_metrics  # noqa: E402
from neuronlocal.device import (  # noqa: E402
    Event,
    Stream,
    StreamContext,
    current_device,
    current_stream,
    default_stream,
    device,
    device_count,
    empty_cache,
    get_device_properties,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_device,
    set_stream,
    stream,
    synchronize,
)
from neuronlocal.eager.tracking import (  # noqa: E402
    clear_op_tracking,
    get_downcast_ops,
    get_executed_ops,
    get_fallback_ops,
)
from neuronlocal.kernels.api import nki_op, wrap_nki  # noqa: E402
from torch_neuronx import _C as _C  # noqa: E402
from torch_neuronx import profiling, utils  # noqa: E402
from torch_neuronx.profiling import NeuronProfiler  # noqa: E402

__version__ = "2.13.3.0+neuronlocal." + neuronlocal.__version__
__all__ = [
    "Event", "NeuronProfiler", "Stream", "StreamContext", "clear_op_tracking", "current_device",
    "current_stream", "default_stream", "device", "device_count", "empty_cache",
    "get_device_properties", "get_downcast_ops", "get_dynamo_metrics", "get_executed_ops",
    "get_fallback_ops", "is_neuron_runtime_initialized", "max_memory_allocated",
    "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
    "memory_summary", "neuron", "nki_op", "profiling", "reset_accumulated_memory_stats",
    "reset_dynamo_metrics", "reset_peak_memory_stats", "set_device", "set_stream", "stream",
    "synchronize", "utils", "wrap_nki",
]

# Host memory survives fork, so a forked child keeps a working device (torch.neuron says why).
_is_in_bad_fork = False


def _lazy_init() -> None:
    """Starts the device runtime if it has not started (idempotent), as TorchNeuron's."""
    neuron.init()


def is_neuron_runtime_initialized() -> bool:
    return bool(neuron.is_initialized())


def _get_device_index(device: torch.device | str | int | None, optional: bool = False,
                      allow_cpu: bool = False) -> int | None:
    """TorchNeuron's device-argument rule: None is the current device (or None if optional),
    a non-neuron device is a ValueError."""
    if device is None:
        return None if optional else current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected neuron device, got {device.type}")
        return device.index if device.index is not None else current_device()
    if isinstance(device, int):
        return device
    raise ValueError(f"Invalid device specification: {device}")
