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
`import torch` stays fast.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from neuronlocal import device as neuron
from neuronlocal import patching

_STOCK: dict[str, Callable[..., Any]] = {}
# Inductor settings per optimisation level (NEURON_CC_FLAGS). Level 1 trades run time for
# compile time, as neuronx-cc's -O1 does: the whole graph in one C++ file (one compiler run
# instead of one per kernel), scalar loops (no vector-tiling search), no C++ optimisation.
# Small graphs compile about 2.5x faster; results match level 2 within float rounding.
OPTLEVEL_PATCHES: dict[int, dict[str, Any]] = {
    1: {"cpp_wrapper": True, "cpp.simdlen": 1, "aot_inductor.debug_compile": True},
    2: {},
    3: {},
}
# Inductor lowerings that compute wrong results in this PyTorch, and the ATen kernels neuron
# graphs use instead (TorchNeuron's compiler computes these ops like the eager kernels):
# average-pool backward with ceil_mode divides a last window that overhangs the input by the
# whole kernel, where eager divides by the part inside the padded input.
# Bump LOWERING_FIXES when this changes: it names the Inductor cache folder, so no graph
# compiled by the wrong lowering is served again.
LOWERING_FIXES = 1
_FIX_CEIL_POOL = ("avg_pool2d_backward", "avg_pool3d_backward")
_fixing: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_fixing", default=False)
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


def on_neuron(gm: Any, example_inputs: Sequence[Any]) -> bool:
    """Whether a graph works on neuron: a neuron input, or (a graph without tensor inputs,
    such as FlexAttention's `create_block_mask`) a value it makes on neuron."""
    if any(isinstance(x, torch.Tensor) and x.device.type == "neuron" for x in example_inputs):
        return True
    if any(isinstance(x, torch.Tensor) for x in example_inputs) or \
            not isinstance(gm, torch.fx.GraphModule):
        return False
    from torch.utils import _pytree as pytree

    return any(isinstance(v, torch.Tensor) and v.device.type == "neuron"
               for node in gm.graph.nodes
               for v in pytree.tree_leaves(node.meta.get("example_value", node.meta.get("val"))))


def optlevel_patches() -> dict[str, Any]:
    """Inductor config patches of the optimisation level NEURON_CC_FLAGS sets now."""
    from neuronlocal.core.config import env_optlevel

    return dict(OPTLEVEL_PATCHES[env_optlevel()])


def _install_lowering_fixes() -> None:
    """Wraps the wrong lowerings once; the wrapper diverts only inside `lowering_fixes()`, so
    Inductor's CPU compiles outside neuron's stay exactly stock."""
    from torch._inductor import lowering

    for name in _FIX_CEIL_POOL:
        op = getattr(torch.ops.aten, name).default
        stock = lowering.lowerings.get(op)
        if stock is None or getattr(stock, "_neuronlocal", False):
            continue
        fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

        def fixed(*args: Any, _stock: Any = stock, _fallback: Any = fallback, **kwargs: Any
                  ) -> Any:
            ceil_mode = args[5] if len(args) > 5 else kwargs.get("ceil_mode", False)
            use = _fallback if ceil_mode and _fixing.get() else _stock
            return use(*args, **kwargs)

        fixed._neuronlocal = True  # type: ignore[attr-defined]
        lowering.lowerings[op] = fixed


@contextlib.contextmanager
def lowering_fixes() -> Iterator[None]:
    """Within: Inductor lowers the ops of `_FIX_CEIL_POOL` with ceil_mode to ATen kernels."""
    _install_lowering_fixes()
    token = _fixing.set(True)
    try:
        yield
    finally:
        _fixing.reset(token)


def stock_compile_fx() -> Callable[..., Any]:
    """Inductor's own compile_fx (the neuron backend compiles CPU graphs with it)."""
    if "compile_fx" not in _STOCK:
        from torch._inductor import compile_fx as mod

        _STOCK.setdefault("compile_fx", mod.compile_fx)
    return _STOCK["compile_fx"]


def _route_compile_fx(mod: Any) -> None:
    stock = _STOCK.setdefault("compile_fx", mod.compile_fx)

    @functools.wraps(stock)
    def compile_fx(model_: Any, example_inputs_: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        if not on_neuron(model_, example_inputs_) or args or set(kwargs) - _ROUTABLE:
            return stock(model_, example_inputs_, *args, **kwargs)
        if V.aot_compilation or (kwargs.get("config_patches") or {}).get("aot_inductor"):
            raise NotImplementedError(
                "ahead-of-time compilation (AOTInductor / torch._export.aot_compile) cannot "
                "target device neuron; use torch.compile(model, backend=\"neuron\") instead.")
        from neuronlocal.compile.backend import neuron_backend

        return neuron_backend(model_, example_inputs_,
                              options={"config_patches": kwargs.get("config_patches")})

    compile_fx._neuronlocal = True  # type: ignore[attr-defined]
    mod.compile_fx = compile_fx


def register() -> None:
    """Installs both seams lazily (see the module docstring)."""
    patching.after_import("torch._dynamo.device_interface", _register_interface)
    patching.after_import("torch._inductor.compile_fx", _route_compile_fx)
