"""Running a compiled graph on neuron tensors: stock Inductor CPU code on zero-copy aliases.

A graph is compiled by stock Inductor for CPU (see backend.py), so everything Inductor and
AOTAutograd cache is exactly what a CPU compile would cache. At run time `CompiledGraph`
hands the compiled function CPU aliases of the neuron inputs (same bytes, one C++ call,
csrc/bridge.cpp) and adopts its CPU outputs back as neuron tensors without copying.

Autograd crosses the bridge at the `torch.autograd.Function` level: when an input needs a
gradient, `_Bridge.forward` runs the compiled function with grad enabled on aliases that
require grad (AOTAutograd builds its own CPU graph), and `_Bridge.backward` asks that graph
for the input gradients and adopts them as neuron tensors. Parameters and gradients
therefore stay neuron tensors for optimizers, DDP hooks and FSDP, while the compiled
artifact stays the stock CPU one (which is what makes warm restarts cheap).

While compiled code runs, its host allocations (workspace, activations saved for backward,
outputs) are counted against the core's HBM, as a compiled graph's buffers would occupy
device memory on Trainium; peak HBM of compiled training therefore includes activations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import _engine_run_backward

from neuronlocal import _C


def output_devices(gm: torch.fx.GraphModule) -> list[bool]:
    """Per graph output: adopt it as a neuron tensor?

    Outputs traced on neuron are adopted. Outputs traced on CPU are adopted too when the
    graph had no neuron input at all (TorchNeuron copies CPU inputs to the device and
    returns device outputs), unless TORCH_NEURONX_RETAIN_DEVICE_MODE=1; a graph that moves
    a neuron tensor to the CPU (`.cpu()`) keeps that output on the CPU.
    """
    from neuronlocal.core.config import env_flag

    def meta(node: Any) -> Any:
        return node.meta.get("example_value", node.meta.get("val")) if isinstance(
            node, torch.fx.Node) else None

    placeholders = [meta(n) for n in gm.graph.nodes if n.op == "placeholder"]
    any_neuron = any(isinstance(v, torch.Tensor) and v.device.type == "neuron"
                     for v in placeholders)
    autocopy = not any_neuron and not env_flag("TORCH_NEURONX_RETAIN_DEVICE_MODE")
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (list, tuple)) else [values]
    out = []
    for node in values:
        v = meta(node)
        out.append(isinstance(v, torch.Tensor) and (v.device.type == "neuron" or autocopy))
    return out


def _call(fn: Callable[..., Any], args: Sequence[Any], index: int) -> Sequence[Any]:
    """Runs compiled code with its host allocations counted against core `index`."""
    prev = _C._set_host_core(index)
    try:
        # compile_fx's result takes positional arguments, as Dynamo calls it (its
        # `_boxed_call` is copied from the inner function by functools.wraps and does not
        # apply).
        return fn(*args)
    finally:
        _C._set_host_core(prev)


class _Bridge(torch.autograd.Function):
    """Connects neuron inputs and outputs to the compiled function's own CPU autograd graph."""

    @staticmethod
    def forward(ctx: Any, graph: CompiledGraph, *args: Any) -> tuple[Any, ...]:
        # The leaves (aliases or detached CPU inputs that require grad) are made in C++.
        cpu_args, index = _C._bridge_in(args, False, graph.leaves)
        torch._C._set_grad_enabled(True)  # forward runs without grad; the CPU graph needs it
        try:
            outs = _call(graph.fn, cpu_args, index)
        finally:
            torch._C._set_grad_enabled(False)
        diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.graph, ctx.diff, ctx.index = graph, diff, index
        # Saved tensors are released after a backward without retain_graph, which frees the
        # CPU graph when autograd would free an eager one.
        ctx.save_for_backward(*[outs[i] for i in diff], *[cpu_args[i] for i in graph.leaf_pos])
        result = _C._bridge_out(outs, index, graph.to_neuron, True)
        if len(diff) < len(result):
            ctx.mark_non_differentiable(*[r for i, r in enumerate(result)
                                          if isinstance(r, torch.Tensor) and i not in diff])
        return tuple(result)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        graph: CompiledGraph = ctx.graph
        saved = ctx.saved_tensors
        outs, leaves = saved[:len(ctx.diff)], saved[len(ctx.diff):]
        # Autograd materialises missing output gradients as zeros, so each one is a tensor.
        grad_outs, _ = _C._bridge_in([grads[i] for i in ctx.diff])
        # The CPU graph is kept exactly when the outer backward keeps its graph. The engine is
        # called as torch.autograd.grad(allow_unused=True) calls it, without its argument
        # checks (the outputs and leaves are the graph's own).
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        prev = _C._set_host_core(ctx.index)
        try:
            in_grads = _engine_run_backward(outs, tuple(grad_outs), keep, False, leaves, True,
                                            accumulate_grad=False)
        finally:
            _C._set_host_core(prev)
        result: list[Any] = [None] * (graph.nargs + 1)
        for pos, g in zip(graph.leaf_pos,
                          _C._bridge_out(in_grads, ctx.index, graph.grad_to_neuron),
                          strict=True):
            result[pos + 1] = g
        return tuple(result)


class CompiledGraph:
    """A compiled graph called with neuron tensors (see the module docstring).

    Everything a call needs to know about its inputs is fixed at compile time, since Dynamo
    guards on it (grad mode, each input's device and requires_grad): which inputs become
    leaves of the CPU graph (none when the call is not differentiable), and which of their
    gradients go back to neuron. `differentiable` False: no autograd through the bridge (a
    caller, AOTAutograd's runtime, does it; or grad mode was off)."""

    def __init__(self, fn: Callable[..., Any], to_neuron: Sequence[bool],
                 example_inputs: Sequence[Any], differentiable: bool) -> None:
        self.fn = fn
        self.to_neuron = list(to_neuron)
        self.nargs = len(example_inputs)
        self.leaves = [differentiable and isinstance(x, torch.Tensor) and x.requires_grad
                       for x in example_inputs]
        self.leaf_pos = [i for i, leaf in enumerate(self.leaves) if leaf]
        self.grad_to_neuron = [example_inputs[i].device.type == "neuron" for i in self.leaf_pos]

    def __call__(self, *args: Any) -> Sequence[Any]:
        if self.leaf_pos:
            return list(_Bridge.apply(self, *args))
        cpu_args, index = _C._bridge_in(args, True)
        # A fresh leaf made inside the graph comes out requiring grad, on neuron too.
        return _C._bridge_out(_call(self.fn, cpu_args, index), index, self.to_neuron, False,
                              True)
