"""TorchNeuron's `NeuronProfiler`: PyTorch's profiler plus a Neuron runtime inspect session.

The runtime session goes through TorchNeuron's binding names (`torch_neuronx._C`'s
`_nrt_inspect_*`, each returning the runtime's status), so its errors are TorchNeuron's
`NRTProfilerError`s. No device exists, so the runtime writes no system or device trace: the
profiler's files are PyTorch's Chrome trace (CPU events, every ATen op on neuron tensors)
and, while both sides run, the framework mapping (`framework_mapping_<time>.json`: each op
executed on neuron with its autograd sequence number, thread and stream), where TorchNeuron
writes them.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

from torch.profiler import ProfilerActivity, profile

import torch_neuronx._C as _C

__all__ = ["NRTProfilerError", "NeuronProfiler"]

logger = logging.getLogger(__name__)

_NRT_DOCS = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/"
             "nrt-api-guide.html#the-libnrt-api")


class NRTProfilerError(Exception):
    """A runtime profiling call returned a non-zero status."""


class NeuronProfiler:
    """Context manager: `with NeuronProfiler(pytorch_activities=[ProfilerActivity.CPU]):`.

    `event_filters` selects runtime events: `{"nc": ["0", "4-7"], "types": [...]}`.
    """

    def __init__(self, pytorch_activities: list[ProfilerActivity] | None = None,
                 record_shapes: bool = False, pytorch_trace_file: str | None = None,
                 neuron_output_dir: str = "./output",
                 event_filters: dict[str, list[str] | list[int]] | None = None) -> None:
        self.pytorch_activities = list(pytorch_activities or [])
        self.record_shapes = record_shapes
        self.neuron_output_dir = neuron_output_dir
        self.pytorch_trace_file: str | None = None
        if self.pytorch_activities:
            name = pytorch_trace_file or "pytorch_trace.json"
            self.pytorch_trace_file = f"{neuron_output_dir}/{name}"
        self.event_filters = event_filters
        self._is_active = False
        self._nrt_active = False
        self._pytorch_active = False
        self._pytorch_profiler: Any = None
        self._nrt_config_capsule: Any = None
        self._framework_mapping_active = False

    # ---- event filters -------------------------------------------------------------------
    def _format_nrt_error(self, base_message: str, status: int) -> str:
        return f"{base_message}. Status: {status}. See {_NRT_DOCS}"

    def _parse_neuroncore_range(self, range_str: str) -> list[int]:
        """'4-7' -> [4, 5, 6, 7] (inclusive), '3' -> [3]; a bad spec is skipped with a warning."""
        range_str = range_str.strip()
        try:
            if "-" in range_str:
                start, end = (int(p.strip()) for p in range_str.split("-", 1))
                if start > end:
                    logger.warning("Invalid range '%s': start > end. Skipping.", range_str)
                    return []
                return list(range(start, end + 1))
            return [int(range_str)]
        except ValueError as err:
            logger.warning("Failed to parse NeuronCore spec '%s': %s. Skipping.", range_str, err)
            return []

    def _parse_neuroncore_list(self, nc_list: list[str]) -> list[int]:
        return sorted({c for spec in nc_list for c in self._parse_neuroncore_range(spec)})

    def _apply_single_filter(self, config_capsule: Any, filter_key: str, filter_data: list[Any],
                             process_func: Callable[[list[Any]], list[Any]],
                             set_capture_func: Callable[[Any, Any, bool], int],
                             item_name: str, filter_type: str) -> None:
        """Enables capture for each item of one filter; failures are warned, not raised (a
        filter narrows the trace, it never stops profiling)."""
        try:
            if isinstance(filter_data, list) and filter_data:
                items = process_func(filter_data)
                logger.info("Applying %s filters: %s", filter_type, items)
                for item in items:
                    status = set_capture_func(config_capsule, item, True)
                    if status != 0:
                        logger.warning("Failed to enable for %s %s, status: %s",
                                       item_name, item, status)
        except Exception as err:  # noqa: BLE001 - see the docstring
            logger.warning("Failed to apply %s filters: %s", filter_type, err)

    def _apply_event_filters(self, config_capsule: Any,
                             event_filters: dict[str, list[str] | list[int]]) -> None:
        if "nc" in event_filters:
            self._apply_single_filter(
                config_capsule, "nc", event_filters["nc"],
                lambda ncs: self._parse_neuroncore_list([str(nc) for nc in ncs]),
                _C._nrt_inspect_config_set_capture_enabled_for_nc, "NeuronCore", "NeuronCore")
        if "types" in event_filters:
            self._apply_single_filter(
                config_capsule, "types", event_filters["types"], lambda types: types,
                _C._nrt_inspect_config_set_capture_enabled_for_event_type_string,
                "event type", "event type")

    # ---- start / stop --------------------------------------------------------------------
    def start(self) -> None:
        if self._is_active:
            raise RuntimeError("Profiler is already active")
        try:
            self._start_nrt_profiling()
            if self.pytorch_activities:
                self._start_pytorch_profiling()
            self._is_active = True
        except Exception:
            self._cleanup()
            raise

    def stop(self) -> None:
        if not self._is_active:
            raise RuntimeError("Profiler is not active")
        errors: list[Exception] = []
        for active, stop in ((self._pytorch_active, self._stop_pytorch_profiling),
                             (self._nrt_active, self._stop_nrt_profiling)):
            if active:
                try:
                    stop()
                except Exception as err:  # noqa: BLE001 - both sides stop; errors are joined
                    errors.append(err)
        self._is_active = False
        if errors:
            details = "\n".join(f"  - {type(e).__name__}: {e}" for e in errors)
            raise RuntimeError(f"Profiling errors:\n{details}")

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NRTProfilerError(self._format_nrt_error(what, status))

    def _start_nrt_profiling(self) -> None:
        try:
            config = _C._nrt_inspect_config_allocate()
            self._nrt_config_capsule = config
            self._check(_C._nrt_inspect_config_set_defaults(config),
                        "Failed to set NRT config defaults")
            self._check(_C._nrt_inspect_config_set_output_dir(config, self.neuron_output_dir),
                        "Failed to set NRT output directory")
            self._check(_C._nrt_inspect_config_set_enable_inspect(config, True),
                        "Failed to enable NRT inspect")
            if self.event_filters:
                self._apply_event_filters(config, self.event_filters)
            self._check(_C._nrt_inspect_begin_with_options(config),
                        "Failed to start NRT profiling")
            self._nrt_active = True
            self._sync_framework_mapping_state()
        except Exception:
            self._nrt_config_capsule = None
            raise

    def _stop_nrt_profiling(self) -> None:
        if not self._nrt_active:
            return
        try:
            self._nrt_active = False
            self._sync_framework_mapping_state()
            self._check(_C._nrt_inspect_stop(), "Failed to stop NRT profiling")
        finally:
            self._nrt_config_capsule = None

    def _sync_framework_mapping_state(self) -> None:
        """The mapping is recorded while both sides run and written when either stops."""
        enabled = self._nrt_active and self._pytorch_active
        _C._set_profiler_mapping_enabled(enabled)
        if not enabled and self._framework_mapping_active:
            try:
                self._dump_profiler_mappings()
            except Exception as err:  # noqa: BLE001 - a mapping never fails the profile
                logger.warning("Failed to dump profiler mappings: %s", err)
        self._framework_mapping_active = enabled

    def _dump_profiler_mappings(self) -> None:
        mappings = _C._get_profiler_mappings()
        if not mappings.get("data"):
            return
        os.makedirs(self.neuron_output_dir, exist_ok=True)
        now = datetime.now()
        stamp = now.strftime("%Y%m%d_%H%M%S") + f"_{now.microsecond // 1000:03d}"
        path = os.path.join(self.neuron_output_dir, f"framework_mapping_{stamp}.json")
        with open(path, "w") as f:
            json.dump(mappings, f, indent=2)

    def _start_pytorch_profiling(self) -> None:
        if not self.pytorch_activities:
            return
        self._pytorch_profiler = profile(activities=self.pytorch_activities,
                                         record_shapes=self.record_shapes)
        self._pytorch_profiler.__enter__()
        self._pytorch_active = True
        self._sync_framework_mapping_state()

    def _stop_pytorch_profiling(self) -> None:
        if not self._pytorch_active or not self._pytorch_profiler:
            return
        try:
            self._pytorch_profiler.__exit__(None, None, None)
            os.makedirs(self.neuron_output_dir, exist_ok=True)
            self._pytorch_profiler.export_chrome_trace(self.pytorch_trace_file)
        finally:
            self._pytorch_active = False
            self._sync_framework_mapping_state()

    def _cleanup(self) -> None:
        """Best-effort stop of whatever started, after a failed start."""
        for active, stop, what in ((self._pytorch_active, self._stop_pytorch_profiling,
                                    "PyTorch"),
                                   (self._nrt_active, self._stop_nrt_profiling, "NRT")):
            if active:
                try:
                    stop()
                except Exception as err:  # noqa: BLE001 - cleanup after another error
                    warnings.warn(f"Failed to cleanup {what} trace: {err}", UserWarning,
                                  stacklevel=2)
        self._is_active = False
        self._pytorch_profiler = None

    def __enter__(self) -> NeuronProfiler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- results -------------------------------------------------------------------------
    def is_active(self) -> bool:
        return self._is_active

    def has_pytorch_profiling(self) -> bool:
        return bool(self.pytorch_activities)

    def get_pytorch_trace(self) -> str | None:
        if self._pytorch_profiler and not self._pytorch_active:
            return str(self._pytorch_profiler)
        return None

    def get_nrt_output_directory(self) -> str:
        return self.neuron_output_dir

    def export_pytorch_trace(self, filename: str) -> None:
        if not self._pytorch_profiler:
            raise ValueError("PyTorch profiling not enabled or not started")
        if self._pytorch_active:
            raise ValueError("Cannot export trace while profiling is active")
        self._pytorch_profiler.export_chrome_trace(filename)
