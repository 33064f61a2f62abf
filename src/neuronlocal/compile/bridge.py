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


def _call(fn: Callable[..., Any], args: list[Any], index: int) -> list[Any]:
    """Runs compiled code with its host allocations counted against core `index`."""
    prev = _C._set_host_core(index)
    try:
        # compile_fx's result takes positional arguments, as Dynamo calls it (its
        # `_boxed_call` is copied from the inner function by functools.wraps and does not
        # apply).
        return list(fn(*args))
    finally:
        _C._set_host_core(prev)


class _Bridge(torch.autograd.Function):
    """Connects neuron inputs and outputs to the compiled function's own CPU autograd graph."""

    @staticmethod
    def forward(ctx: Any, graph: CompiledGraph, *args: Any) -> tuple[Any, ...]:
        cpu_args, index = _C._bridge_in(list(args))
        leaves = []
        for i, (a, c) in enumerate(zip(args, cpu_args, strict=True)):
            if isinstance(a, torch.Tensor) and a.requires_grad and c is not a:
                cpu_args[i] = c.requires_grad_(True)
                leaves.append(i)
            elif isinstance(a, torch.Tensor) and a.requires_grad:  # a CPU input
                cpu_args[i] = c.detach().requires_grad_(True)
                leaves.append(i)
        with torch.enable_grad():
            outs = _call(graph.fn, cpu_args, index)
        diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.diff, ctx.leaves, ctx.nargs, ctx.index = diff, leaves, len(args), index
        ctx.input_neuron = [isinstance(args[i], torch.Tensor) and args[i].device.type == "neuron"
                            for i in leaves]
        # Saved tensors are released after a backward without retain_graph, which frees the
        # CPU graph when autograd would free an eager one.
        ctx.save_for_backward(*[outs[i] for i in diff], *[cpu_args[i] for i in leaves])
        result = _C._bridge_out([o.detach() if isinstance(o, torch.Tensor) else o for o in outs],
                                index, graph.to_neuron)
        ctx.mark_non_differentiable(*[r for i, r in enumerate(result)
                                      if isinstance(r, torch.Tensor) and i not in diff])
        return tuple(result)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        outs, leaves = saved[:len(ctx.diff)], saved[len(ctx.diff):]
        grad_outs = []
        for i, o in zip(ctx.diff, outs, strict=True):
            g = grads[i]
            if g is None:
                g = torch.zeros_like(o)
            elif g.device.type == "neuron":
                g = _C._cpu_alias(g)
            grad_outs.append(g)
        # The CPU graph is kept exactly when the outer backward keeps its graph.
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        prev = _C._set_host_core(ctx.index)
        try:
            in_grads = torch.autograd.grad(outs, leaves, grad_outs, allow_unused=True,
                                           retain_graph=keep)
        finally:
            _C._set_host_core(prev)
        result: list[Any] = [None] * ctx.nargs
        for pos, g, to_neuron in zip(ctx.leaves, in_grads, ctx.input_neuron, strict=True):
            if g is not None and to_neuron:
                g = _C._bridge_out([g], ctx.index)[0]
            result[pos] = g
        return (None, *result)


class CompiledGraph:
    """A compiled graph called with neuron tensors (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], to_neuron: Sequence[bool],
                 autograd: bool = True) -> None:
        self.fn = fn
        self.to_neuron = list(to_neuron)
        self.autograd = autograd  # False: a caller (AOTAutograd's runtime) does autograd

    def __call__(self, *args: Any) -> list[Any]:
        if self.autograd and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return list(_Bridge.apply(self, *args))
        cpu_args, index = _C._bridge_in(list(args), True)
        outs = _call(self.fn, cpu_args, index)
        result = _C._bridge_out(outs, index, self.to_neuron)
        for i, (o, r) in enumerate(zip(outs, result, strict=True)):
            if isinstance(o, torch.Tensor) and o.requires_grad and r is not o:
                result[i] = r.requires_grad_(True)  # a fresh leaf made inside the graph
        return result
