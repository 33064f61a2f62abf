"""TorchNeuron's private binding names that its Python layer and code written for it call,
delegating to `torch.neuron` (neuronlocal's C++ core has its own bindings, `neuronlocal._C`)."""

from __future__ import annotations

import types
from typing import Any

import torch

from neuronlocal import _C as _neuronlocal_C
from neuronlocal import device as _neuron
from neuronlocal import memory as _memory
from neuronlocal.compile import megacache as _megacache
from neuronlocal.eager import tracking as _tracking
from torch_neuronx._nrt_inspect import (  # noqa: F401  (TorchNeuron's binding names)
    _nrt_inspect_begin_with_options,
    _nrt_inspect_config_allocate,
    _nrt_inspect_config_set_capture_enabled_for_event_type_string,
    _nrt_inspect_config_set_capture_enabled_for_nc,
    _nrt_inspect_config_set_defaults,
    _nrt_inspect_config_set_enable_inspect,
    _nrt_inspect_config_set_output_dir,
    _nrt_inspect_stop,
)


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


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 CPU tensor (a neuron tensor's CPU alias)."""
    host = _neuronlocal_C._cpu_alias(t) if t.device.type == "neuron" else t
    return host.reshape(-1).view(torch.uint8)


def _raw_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    if not src.is_contiguous():
        src = src.contiguous()
    if not dst.is_contiguous():
        raise RuntimeError("Destination tensor must be contiguous")
    if src.nbytes != dst.nbytes:
        raise RuntimeError("Source and destination must have same number of bytes")
    if dst.nbytes:
        _raw_bytes(dst).copy_(_raw_bytes(src))


def _nrt_copy_cpu_to_neuron_tensor(src_cpu: torch.Tensor, dst_neuron: torch.Tensor,
                                   non_blocking: bool = False) -> None:
    """TorchNeuron's raw host-to-device transfer: the bytes as they are, no cast."""
    if not src_cpu.is_cpu:
        raise RuntimeError("Source tensor must be CPU tensor")
    if dst_neuron.device.type != "neuron":
        raise RuntimeError("Destination tensor must be Neuron tensor")
    _raw_copy(src_cpu, dst_neuron)


def _nrt_copy_neuron_to_cpu_tensor(src_neuron: torch.Tensor, dst_cpu: torch.Tensor,
                                   non_blocking: bool = False) -> None:
    """TorchNeuron's raw device-to-host transfer: the bytes as they are, no cast."""
    if src_neuron.device.type != "neuron":
        raise RuntimeError("Source must be Neuron tensor")
    if not dst_cpu.is_cpu:
        raise RuntimeError("Destination tensor must be CPU tensor")
    _raw_copy(src_neuron, dst_cpu)


def _nrt_copy_neuron_to_neuron_tensor(src_neuron: torch.Tensor, dst_neuron: torch.Tensor,
                                      non_blocking: bool = False) -> None:
    """TorchNeuron's raw device-to-device copy, within one core."""
    if src_neuron.device.type != "neuron" or dst_neuron.device.type != "neuron":
        raise RuntimeError("Source and destination must be Neuron tensors")
    if src_neuron.device != dst_neuron.device:
        raise RuntimeError("Device-to-device copy requires tensors on same Neuron core")
    _raw_copy(src_neuron, dst_neuron)


def _set_profiler_mapping_enabled(enabled: bool) -> None:
    """While on, each op executed on neuron is recorded for the profiler's framework mapping."""
    _neuronlocal_C._set_profiler_mapping_enabled(bool(enabled))


def _get_profiler_mappings() -> dict[str, Any]:
    """`{"version": 1, "data": [{"nrta_seq_id", "framework_op_exec_ids": [{"seq_nr", "th_id",
    "stream_id"}]}]}` for the executions since the last call (then cleared)."""
    _neuron.synchronize()
    return _neuronlocal_C._get_profiler_mappings()


def put_neff_cache(key: str, neff_bytes: bytes) -> bool:
    """Writes a compiled graph's bytes to the persistent cache under `key` (MegaCache's
    load); False when the cache is disabled or cannot be written."""
    return _megacache.put(key, neff_bytes)


def get_neff_cache(key: str) -> bytes | None:
    """The persistent cache's bytes for `key`, or None (missing or empty)."""
    return _megacache.get(key)


def get_neff_info(cache_key: str) -> tuple[str, bytes] | None:
    """`(persistent key, bytes)` of a graph this process compiled, by its cache key (the keys
    `get_compiled_cache_keys` lists), or None."""
    return _megacache.COMPILATION_CACHE.info(cache_key)


def _get_compilation_cache_stats() -> dict[str, Any]:
    """Graphs in the in-memory compilation cache (`total_entries`) and the persistent hits,
    misses and compile time counted while metrics are enabled."""
    return _megacache.COMPILATION_CACHE.stats()


def _clear_compilation_cache() -> None:
    """Forgets the compiled graphs' bytes and counts and removes the persistent byte files."""
    _megacache.COMPILATION_CACHE.clear()


def _clear_compilation_memory_cache() -> None:
    _megacache.COMPILATION_CACHE.clear(persistent=False)


def _neuron_set_metrics_enabled(enabled: bool) -> None:
    _megacache.COMPILATION_CACHE.metrics_enabled = bool(enabled)


def _neuron_metrics_enabled() -> bool:
    return _megacache.COMPILATION_CACHE.metrics_enabled


# TorchNeuron's allocator submodule: `get()` is its allocator (here the module that is
# neuronlocal's allocator interface), `emptyCache()` frees every core's cached blocks.
NeuronCachingAllocator = types.SimpleNamespace(get=lambda: _memory, emptyCache=_memory.empty_cache)
