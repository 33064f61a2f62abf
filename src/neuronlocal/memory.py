"""torch.neuron memory API: HBM accounting per logical core, mirroring torch.cuda.

The counters live in the C++ allocator (csrc/hbm.cpp), which emulates TorchNeuron's
caching segment allocator, so `reserved >= allocated >= active` always holds.
`memory_stats()` has TorchNeuron's keys (`allocated_bytes`, `reserved_bytes`,
`active_bytes`, ... each a dict of current, peak, allocated and freed; the counters
`num_ooms`, `num_alloc_retries`, `num_tensor_frees`, `allocation_requests`), and CUDA's
flat keys (`allocated_bytes.all.current`, ...) that code written for torch.cuda reads, plus
`hbm_bytes`, the core's budget.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from neuronlocal import _C
from neuronlocal.core.units import fmt_bytes

Device = torch.device | str | int | None

__all__ = [
    "empty_cache", "max_memory_allocated", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
    "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_peak_memory_stats",
]


def device_index(device: Device = None, optional: bool = True) -> int:
    """Normalises None / int / 'neuron:1' / torch.device to a validated core index."""
    if device is None:
        return _C._current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, got {device}.")
        if device.index is None:
            return _C._current_device()
        device = device.index
    if not isinstance(device, int):
        raise TypeError(f"Invalid device {device!r}: use an int, 'neuron:i' or torch.device.")
    _C._check_index(device)
    return device


def memory_stats(device: Device = None) -> dict[str, Any]:
    """Allocator statistics for one core: TorchNeuron's nested keys and CUDA's flat ones."""
    flat = _C._memory_stats(device_index(device))
    out: dict[str, Any] = OrderedDict(sorted(flat.items()))
    for key, value in flat.items():
        name, pool, field = (key.split(".") + ["", ""])[:3]
        if pool == "all":
            out.setdefault(name, {})[field] = value
    return out


def memory_allocated(device: Device = None) -> int:
    return _C._memory_stats(device_index(device))["allocated_bytes.all.current"]


def max_memory_allocated(device: Device = None) -> int:
    return _C._memory_stats(device_index(device))["allocated_bytes.all.peak"]


def memory_reserved(device: Device = None) -> int:
    return _C._memory_stats(device_index(device))["reserved_bytes.all.current"]


def max_memory_reserved(device: Device = None) -> int:
    return _C._memory_stats(device_index(device))["reserved_bytes.all.peak"]


def mem_get_info(device: Device = None) -> tuple[int, int]:
    """(free, total) HBM bytes of the core, like torch.cuda.mem_get_info."""
    stats = _C._memory_stats(device_index(device))
    total = stats["hbm_bytes"]
    return total - stats["reserved_bytes.all.current"], total


def reset_peak_memory_stats(device: Device = None) -> None:
    _C._reset_peak(device_index(device))


def reset_max_memory_allocated(device: Device = None) -> None:
    _C._reset_peak(device_index(device))


def high_water_marks(index: int) -> tuple[int, int]:
    """Peak (allocated, reserved) bytes of core `index` since `reset_high_water_marks`.

    The allocator keeps them apart from the peak counters, so no reset the program makes
    (torch.neuron's, torch.accelerator's: torchtitan resets every step) lowers them. Not
    part of torch.neuron's API: the run report reads them.
    """
    allocated, reserved = _C._high_water_marks(index)
    return int(allocated), int(reserved)


def reset_high_water_marks(index: int) -> None:
    """Starts a run's high-water marks (and the peak counters) for core `index` afresh."""
    _C._reset_high_water(index)


def reset_accumulated_memory_stats(device: Device = None) -> None:
    _C._reset_accumulated(device_index(device))


def empty_cache(device: Device = None) -> None:
    """Releases cached, unused blocks of every core (or one core) back to HBM."""
    if device is not None:
        _C._empty_cache(device_index(device))
        return
    for i in range(_C._device_count()):
        _C._empty_cache(i)


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """A human-readable table of the allocator statistics of one core."""
    index = device_index(device)
    s = memory_stats(index)
    lines = [
        f"Neuron Memory Summary, Device {index} (neuron:{index}, HBM per core "
        f"{fmt_bytes(s['hbm_bytes'])})",
        f"{'metric':<22}{'current':>14}{'peak':>14}{'allocated':>14}{'freed':>14}",
    ]
    metrics = ["allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"]
    pools = ["all"] if abbreviated else ["all", "small_pool", "large_pool"]
    for m in metrics:
        for p in pools:
            vals = [fmt_bytes(s[f"{m}.{p}.{k}"]) for k in ("current", "peak", "allocated", "freed")]
            label = m if p == "all" else f"  {p}"
            lines.append(f"{label:<22}" + "".join(f"{v:>14}" for v in vals))
    for k in ("allocation_requests", "num_alloc_retries", "num_ooms", "num_tensor_frees"):
        lines.append(f"{k:<22}{s[k]:>14}")
    return "\n".join(lines)
