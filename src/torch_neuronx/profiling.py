"""TorchNeuron's `NeuronProfiler`: PyTorch's profiler plus the Neuron runtime's traces.

No device exists, so there is no runtime (system or device) trace: the profiler records
the PyTorch side only (CPU events, every ATen op on neuron tensors; README's profiling
section) and writes its Chrome trace where TorchNeuron writes it.
"""

from __future__ import annotations

import os
from typing import Any

from torch.profiler import ProfilerActivity, profile

__all__ = ["NeuronProfiler"]


class NeuronProfiler:
    """Context manager: `with NeuronProfiler(pytorch_activities=[ProfilerActivity.CPU]):`.

    `event_filters` select runtime events in TorchNeuron; accepted here and unused (no
    runtime trace exists).
    """

    def __init__(self, pytorch_activities: list[ProfilerActivity] | None = None,
                 record_shapes: bool = False, pytorch_trace_file: str | None = None,
                 neuron_output_dir: str = "./output",
                 event_filters: dict[str, list[str] | list[int]] | None = None) -> None:
        self.pytorch_activities = list(pytorch_activities or [])
        self.record_shapes = record_shapes
        self.neuron_output_dir = neuron_output_dir
        self.event_filters = event_filters or {}
        name = pytorch_trace_file or "pytorch_trace.json"
        self.pytorch_trace_file = os.path.join(neuron_output_dir, os.path.basename(name))
        self._profiler: Any = None
        self._is_active = False

    def start(self) -> None:
        if self._is_active:
            raise RuntimeError("Profiler is already active")
        if self.pytorch_activities:
            self._profiler = profile(activities=self.pytorch_activities,
                                     record_shapes=self.record_shapes)
            self._profiler.__enter__()
        self._is_active = True

    def stop(self) -> None:
        if not self._is_active:
            raise RuntimeError("Profiler is not active")
        self._is_active = False
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            os.makedirs(self.neuron_output_dir, exist_ok=True)
            self._profiler.export_chrome_trace(self.pytorch_trace_file)

    def is_active(self) -> bool:
        return self._is_active

    def __enter__(self) -> NeuronProfiler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
