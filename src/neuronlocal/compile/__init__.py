"""torch.compile for neuron: backend, two-tier cache, metrics, bucketing helpers."""

from __future__ import annotations

from neuronlocal.compile.backend import NeuronDynamicShapesError, neuron_backend
from neuronlocal.compile.static import NEFFCompilationError
from neuronlocal.core.dynamo_metrics import (
    get_dynamo_metrics,
    get_model_name,
    reset_dynamo_metrics,
    set_model_name,
)

__all__ = [
    "NEFFCompilationError", "NeuronDynamicShapesError", "get_dynamo_metrics", "get_model_name",
    "neuron_backend", "reset_dynamo_metrics", "set_model_name",
]
