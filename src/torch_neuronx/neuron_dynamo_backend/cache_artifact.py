"""TorchNeuron's `torch_neuronx.neuron_dynamo_backend.cache_artifact`: its artifact types and
the `neuron_neff` MegaCache artifact (registered with torch's MegaCache by neuronlocal, which
also has `save_cache_artifacts()` collect the compiled graphs; see `compile/megacache.py`)."""

from __future__ import annotations

from neuronlocal.compile.cache import ArtifactType
from neuronlocal.compile.megacache import artifact_class

NeuronNeffCacheArtifact = artifact_class()

__all__ = ["ArtifactType", "NeuronNeffCacheArtifact"]
