"""TorchNeuron's `torch_neuronx.neuron_dynamo_backend` helper API (a package there too: its
cache-key API lives in the `compile` and `cache_artifact` submodules)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from neuronlocal.compile.backend import neuron_backend
from neuronlocal.compile.static import NEFFCompilationError
from neuronlocal.core.dynamo_metrics import (
    get_dynamo_metrics,
    get_model_name,
    reset_dynamo_metrics,
    set_model_name,
)

Backend = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]


class NEFFExecutionError(RuntimeError):
    """TorchNeuron's error for a compiled graph that fails on the device. Part of its public
    API, so code that catches it imports here; compiled graphs run on the host here and
    raise the underlying error (e.g. torch.OutOfMemoryError) instead."""


def create_neuron_backend(**options: Any) -> Backend:
    """A backend callable with fixed options, for torch.compile(backend=...)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return neuron_backend(gm, example_inputs, options=options)

    return backend


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = [
    "NEFFCompilationError", "NEFFExecutionError", "create_neuron_backend", "get_dynamo_metrics",
    "get_model_name", "get_rank", "neuron_backend", "reset_dynamo_metrics", "set_model_name",
]
