"""TorchNeuron's `torch_neuronx.neuron_dynamo_backend` helper API (spec 3.6)."""

from __future__ import annotations

from typing import Any

from neuronlocal.compile.backend import NEFFCompilationError, neuron_backend
from neuronlocal.compile.metrics import (
    get_dynamo_metrics,
    get_model_name,
    reset_dynamo_metrics,
    set_model_name,
)


class NEFFExecutionError(RuntimeError):
    """A compiled graph failed while running."""


def create_neuron_backend(**options: Any):  # type: ignore[no-untyped-def]
    """A backend callable with fixed options, for torch.compile(backend=...)."""

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        return neuron_backend(gm, example_inputs, options=options)

    return backend


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = [
    "NEFFCompilationError", "NEFFExecutionError", "create_neuron_backend", "get_dynamo_metrics",
    "get_model_name", "get_rank", "neuron_backend", "reset_dynamo_metrics", "set_model_name",
]
