"""Graphs with tensor-subclass inputs (DTensor, any traceable wrapper subclass).

A compiled tensor-parallel model hands the backend DTensor parameters and activations. The
bridge aliases plain neuron tensors only, so such a graph is first desugared by AOTAutograd,
as stock Inductor does: AOTAutograd traces through the subclasses' own dispatch (DTensor's
sharding propagation and redistribution become `_c10d_functional` collectives), and its
forward, backward and inference compilers receive plain graphs whose inputs are the inner
neuron tensors (a DTensor's local shard). Each of those graphs is compiled exactly like a
graph without subclasses (rewritten to CPU, stock Inductor on CPU fakes, the zero-copy
bridge), except that the bridge stays out of autograd: AOTAutograd's runtime connects the
compiled backward and wraps outputs and gradients back into subclasses. Collectives in
those graphs run on the CPU aliases through the `neuron` process group, which accepts CPU
tensors (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from neuronlocal.compile.static import NEFFCompilationError, compile_failed, compile_static


def has_subclass(args: Sequence[Any]) -> bool:
    """Does any input need desugaring (a traceable wrapper subclass such as DTensor)?"""
    return any(is_traceable_wrapper_subclass(a) for a in args)


def compile_desugared(gm: fx.GraphModule, args: Sequence[Any], options: dict[str, Any],
                      kind: str, extra: dict[str, Any]) -> Callable[..., Any]:
    """AOTAutograd over the subclasses of `args` (real inputs of the first call); each plain
    graph it produces compiles through `static.compile_static` without autograd."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def compiler(part: str) -> Callable[..., Any]:
        def compile_part(inner: fx.GraphModule, examples: Sequence[Any]) -> Callable[..., Any]:
            # AOTAutograd calls its compiled parts with one list of arguments.
            return make_boxed_func(compile_static(inner, list(examples), options, kind=kind,
                                                  extra={**extra, "part": part},
                                                  autograd=False))
        return compile_part

    # Static fakes from a mode of our own, as for plain graphs: every size is an integer.
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    try:
        fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor)
                 else a for a in args]
        with tracing(TracingContext(fake_mode)):
            return aot_module_simplified(gm, fakes, fw_compiler=compiler("forward"),
                                         bw_compiler=compiler("backward"),
                                         inference_compiler=compiler("inference"),
                                         keep_inference_input_mutations=True)
    except NEFFCompilationError:
        raise  # a part failed and said so
    except Exception as err:
        compile_failed(err, getattr(gm, "_neuron_name", None) or "graph",
                       len(gm.graph.nodes), options)
        return gm.forward
