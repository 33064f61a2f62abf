"""Dynamo and Inductor seams for device `neuron`: the device interface, and the default backend.

- Dynamo asks a device interface (current device, streams, properties) of every device it
  sees in a graph; `NeuronInterface` answers for neuron from `torch.neuron`.
- `torch.compile(model)` without a backend means Inductor, which has no code generator for
  device `neuron` and would stop with a lowering assertion. TorchNeuron picks its own
  backend on a Neuron device, so graphs whose inputs live on neuron are handed to the
  neuron backend, with Inductor's config patches (mode, options) applied to the CPU compile.
  Everything else reaches Inductor untouched. Ahead-of-time compilation (AOTInductor,
  export) cannot target neuron and says so in one line.

Both are installed when the PyTorch module is first imported (neuronlocal.patching), so
`import torch` stays fast; so are the lowering fixes (compile/lowering.py), when Inductor's
lowering module is first imported. With NEURONLOCAL_COMPILER=inductor, Inductor's compiler
loads with Dynamo (as stock Inductor's loads at torch.compile), not in the first compiled call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from neuronlocal import device as neuron
from neuronlocal import patching
from neuronlocal.compile.backend import neuron_backend
from neuronlocal.compile.lowering import install_lowering_fixes, stock_compile_fx
from neuronlocal.compile.static import on_neuron
from neuronlocal.core.config import env_compiler

# compile_fx arguments torch.compile's Inductor wrapper passes; any other (a custom
# inner_compile, decompositions) means a caller that drives Inductor itself.
_ROUTABLE = {"config_patches", "compile_region_name"}


class NeuronInterface:
    """Dynamo's DeviceInterface for neuron (built lazily: see `_register_interface`)."""


def _register_interface(mod: ModuleType) -> None:
    import multiprocessing

    base = mod.DeviceInterface

    class _Props:
        multi_processor_count = multiprocessing.cpu_count()

    class Interface(base):  # type: ignore[misc, valid-type]
        class device:  # noqa: N801  (Dynamo's name)
            def __new__(cls, device: Any) -> Any:
                return neuron.device(device)

        Event = torch.Event
        Stream = torch.Stream

        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                neuron.set_device(device)

            @staticmethod
            def current_device() -> int:
                return neuron.current_device()

            @staticmethod
            def get_device_properties(device: Any = None) -> Any:
                return _Props()

        current_device = staticmethod(lambda: neuron.current_device())
        set_device = staticmethod(lambda device: neuron.set_device(device))
        device_count = staticmethod(lambda: neuron.device_count())
        is_available = staticmethod(lambda: neuron.is_available())
        synchronize = staticmethod(lambda device=None: neuron.synchronize(device))
        current_stream = staticmethod(lambda: neuron.current_stream())
        set_stream = staticmethod(lambda stream: neuron.set_stream(stream))
        get_raw_stream = staticmethod(lambda device_idx: 0)
        get_compute_capability = staticmethod(lambda device=None: "")
        is_bf16_supported = staticmethod(lambda including_emulation=False: True)
        is_triton_capable = staticmethod(lambda device=None: False)
        memory_allocated = staticmethod(lambda device=None: neuron.memory_allocated(device))

        @staticmethod
        def maybe_exchange_device(device: int) -> int:
            prev = neuron.current_device()
            if device >= 0:
                neuron.set_device(device)
            return prev

        exchange_device = maybe_exchange_device

        @classmethod
        def get_device_properties(cls, device: Any = None) -> Any:
            return _Props()

    Interface.__name__ = Interface.__qualname__ = "NeuronInterface"
    globals()["NeuronInterface"] = Interface
    mod.register_interface_for_device("neuron", Interface)
    for i in range(neuron.device_count()):
        mod.register_interface_for_device(f"neuron:{i}", Interface)


def _route_compile_fx(mod: Any) -> None:
    stock = stock_compile_fx(mod)

    @functools.wraps(stock)
    def compile_fx(model_: Any, example_inputs_: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        if not on_neuron(model_, example_inputs_) or args or set(kwargs) - _ROUTABLE:
            return stock(model_, example_inputs_, *args, **kwargs)
        if V.aot_compilation or (kwargs.get("config_patches") or {}).get("aot_inductor"):
            raise NotImplementedError(
                "ahead-of-time compilation (AOTInductor / torch._export.aot_compile) cannot "
                "target device neuron; use torch.compile(model, backend=\"neuron\") instead.")
        return neuron_backend(model_, example_inputs_,
                              options={"config_patches": kwargs.get("config_patches")})

    compile_fx._neuronlocal = True  # type: ignore[attr-defined]
    mod.compile_fx = compile_fx


def _load_inductor(dynamo: ModuleType) -> None:
    """With NEURONLOCAL_COMPILER=inductor, Inductor's compiler loads with Dynamo, as stock
    Inductor loads it when torch.compile picks it: a new process's first compiled call then
    does the same work as stock Inductor's, not also this import. Skipped while another
    PyTorch module is mid-import (one that imports Dynamo, such as Inductor itself)."""
    if env_compiler() != "inductor" or any(
            getattr(getattr(m, "__spec__", None), "_initializing", False)
            for name, m in list(sys.modules.items())
            if name.startswith("torch.") and m is not dynamo):
        return
    stock_compile_fx()


def register() -> None:
    """Installs both seams and the lowering fixes lazily (see the module docstring)."""
    patching.after_import("torch._dynamo", _load_inductor)
    patching.after_import("torch._dynamo.device_interface", _register_interface)
    patching.after_import("torch._inductor.compile_fx", _route_compile_fx)
    patching.after_import("torch._inductor.lowering", install_lowering_fixes)
