"""TorchNeuron's `torch_neuronx.neuron_dynamo_backend.cache_artifact`: its artifact types."""

from __future__ import annotations

from neuronlocal.compile.cache import ArtifactType

__all__ = ["ArtifactType"]
