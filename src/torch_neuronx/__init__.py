"""Compatibility package: the names TorchNeuron's `torch_neuronx` exposes, backed by neuronlocal.

Its presence is also what transformers and accelerate look for
(`importlib.util.find_spec("torch_neuronx")`) before checking `torch.neuron.is_available()`.
"""

from __future__ import annotations

import neuronlocal
from neuronlocal.device import (
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    synchronize,
)
from neuronlocal.eager.tracking import (
    clear_op_tracking,
    get_downcast_ops,
    get_executed_ops,
    get_fallback_ops,
)
from neuronlocal.kernels.api import nki_op, wrap_nki

__version__ = "2.13.3.0+neuronlocal." + neuronlocal.__version__
__all__ = [
    "clear_op_tracking", "empty_cache", "get_downcast_ops", "get_executed_ops", "get_fallback_ops",
    "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
    "memory_stats", "memory_summary", "nki_op", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "synchronize", "wrap_nki",
]

