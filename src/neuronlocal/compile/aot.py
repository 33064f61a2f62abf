"""The default compile stage: AOTAutograd's graphs, run by the neuron eager path.

TorchNeuron hands AOTAutograd's forward and backward graphs to neuronx-cc. Here they run op
by op on neuron tensors through the same dispatch as eager mode: op placement, CPU-fallback
tracking, the 64-bit rule, HBM accounting and the core's random generator (compiled dropout
draws what eager draws). A compile therefore costs Dynamo's trace plus AOTAutograd's, with
no code generation and no C++ build. Tensor subclasses (DTensor) are desugared by the same
AOTAutograd call, so their graphs run on the inner neuron tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx


def _runner(part: str, sizes: dict[str, int]) -> Callable[..., Any]:
    def compile_part(inner: fx.GraphModule, examples: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import make_boxed_func

        sizes[part] = len(inner.graph.nodes)
        return make_boxed_func(inner.forward)  # AOTAutograd calls parts with one list
    return compile_part


def autocopied(args: Sequence[Any]) -> list[Any]:
    """CPU tensors (other than scalars) of a graph with neuron inputs, moved to its core:
    TorchNeuron copies CPU inputs of a compiled graph to the device."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)
                   and a.device.type == "neuron"), None)
    if device is None:
        return list(args)
    return [a.to(device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim()
            else a for a in args]


def compile_parts(gm: fx.GraphModule, args: Sequence[Any]) -> tuple[Callable[..., Any],
                                                                   dict[str, int]]:
    """AOTAutograd over `gm` at the static shapes of `args` (real inputs of the first call).
    Returns the callable Dynamo runs and the node count of each part it made (forward and
    backward, or inference)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    sizes: dict[str, int] = {}
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # static: every size is an integer
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in args]
    # The backward is made with the forward, so a compile is complete when it returns.
    with tracing(TracingContext(fake_mode)), \
            functorch_config.patch(force_non_lazy_backward_lowering=True):
        fn = aot_module_simplified(gm, fakes, fw_compiler=_runner("forward", sizes),
                                   bw_compiler=_runner("backward", sizes),
                                   inference_compiler=_runner("inference", sizes),
                                   keep_inference_input_mutations=True)
    return fn, sizes
