"""TorchNeuron's `torch_neuronx.neuron_dynamo_backend.compile`: the compiled-graph cache keys.

`get_compiled_cache_keys(ArtifactType.NEURON_NEFF)` lists the keys of the graphs this process
compiled (or took from the cache) since `clear_compiled_cache_keys()`; ranks of an SPMD job
compiling one graph list the same key.
"""

from __future__ import annotations

from neuronlocal.compile.cache import (
    ArtifactType,
    clear_compiled_cache_keys,
    get_compiled_cache_keys,
)

__all__ = ["ArtifactType", "clear_compiled_cache_keys", "get_compiled_cache_keys"]
