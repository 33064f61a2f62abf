"""neuronlocal's local kernel repository, variant `torch-neuron` (loaded by HF `kernels`)."""

from neuronlocal.kernels import layers

__all__ = ["layers"]
