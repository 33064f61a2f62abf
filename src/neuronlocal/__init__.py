"""neuronlocal: TorchNeuron, the PyTorch backend for AWS Trainium, on any machine.

`import torch` is enough: the `torch.backends` entry point calls `_autoload`, which
imports this package. Importing it registers everything, once, in this order:

1. read the configuration (config); the instance profile (hardware: which cores this
   process sees) is read when the device runtime starts, at the first device use
   (`core.state.start`, called by the C++ core), so the core variables may be set after
   `import torch`. A bad environment variable never makes either fail: it is kept in
   `config_error`, the device has no visible core, and its use raises that one-line error;
2. rename PrivateUse1 to `neuron`;
3. the C++ core: device guard, hooks, HBM allocator, eager kernels (neuronlocal._C), with
   the runtime's starter; in a dry run (NEURONLOCAL_DRY_RUN=1) its data-less mode
   (core.dryrun);
4. eager policy: CPU-fallback op list, 64-bit policy, direct kernels (eager);
5. register `torch.neuron` (device) and generate `.neuron()` methods; higher-order
   operators fall through neuron's autocast key, as through CPU's and CUDA's (amp);
6. c10d backend `neuron` and functional-collective kernels (distributed), if available;
7. torch.compile seams: Dynamo's device interface and the default (Inductor) backend on
   neuron (compile.inductor), the `neuron_neff` MegaCache artifact (compile.megacache),
   FlexAttention's device check under Dynamo (compile.flex), installed when those PyTorch
   modules are imported;
8. Hugging Face glue: lazy import hooks, nothing imported now (hf).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from neuronlocal.core import VERSION
from neuronlocal.core import dryrun as _dryrun
from neuronlocal.core import logs as _logs
from neuronlocal.core import state as _state

_logs.configure(_state.config.log_level)  # TORCH_NEURONX_LOG_LEVEL

torch.utils.rename_privateuse1_backend("neuron")

import neuronlocal._C as _C  # noqa: E402  (needs the rename above)

_C._init(_state.start)
if _dryrun.enabled():  # NEURONLOCAL_DRY_RUN: data-less tensors, before any is made
    _dryrun.install()

from neuronlocal import device, eager  # noqa: E402
from neuronlocal.eager.tracking import (  # noqa: E402
    clear_op_tracking,
    get_downcast_ops,
    get_executed_ops,
    get_fallback_ops,
    get_fallback_traffic,
)

eager.register(_state.config)
torch._register_device_module("neuron", device)
sys.modules["torch.neuron.amp"] = device.amp  # `import torch.neuron.amp` works too
device.amp.hops_fall_through_autocast()
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_storage=True, for_packed_sequence=True
)
from neuronlocal import distributed, hf  # noqa: E402
from neuronlocal.compile import flex as _flex  # noqa: E402
from neuronlocal.compile import inductor as _inductor  # noqa: E402
from neuronlocal.compile import megacache as _megacache  # noqa: E402

distributed.register()
_inductor.register()
_megacache.register()
_flex.register()
hf.register()

__version__ = VERSION


def __getattr__(name: str) -> Any:
    """`neuronlocal.config`: the current config (it changes with `eager.set_policy`);
    `.profile` and `.config_error`: what the runtime found when it started (reading them
    starts it)."""
    if name in ("config", "profile", "config_error"):
        return getattr(_state, name)
    raise AttributeError(f"module 'neuronlocal' has no attribute {name!r}")


__all__ = [
    "clear_op_tracking", "config", "config_error", "device", "get_downcast_ops", "get_executed_ops",
    "get_fallback_ops", "get_fallback_traffic", "profile",
]
