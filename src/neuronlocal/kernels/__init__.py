"""Custom kernels on neuron: `nki_op`, a host-fast kernel library, HF `kernels`.

Modules, one per seam: `api` (nki_op, wrap_nki), `library` (the kernels), `layers` (nn.Module
layers HF `kernels` swaps in), `hub` (the local layer repository mapping, `kernelize`).
Imported lazily: nothing here runs at `import torch`.
"""

from __future__ import annotations

from typing import Any

from neuronlocal.kernels.api import host_call, nki_op, wrap_nki

_LIBRARY = {"apply_rotary", "attention", "cached_attention", "rms_norm", "silu_and_mul"}
_HUB = {"kernel_config", "kernel_mapping", "kernelize", "register", "REPO_PATH"}

__all__ = ["host_call", "nki_op", "wrap_nki", *sorted(_LIBRARY), *sorted(_HUB)]


def __getattr__(name: str) -> Any:
    if name in _LIBRARY:
        from neuronlocal.kernels import library

        return getattr(library, name)
    if name in _HUB:
        from neuronlocal.kernels import hub

        return getattr(hub, name)
    raise AttributeError(f"module 'neuronlocal.kernels' has no attribute {name!r}")
