"""torch.compile(backend="neuron"): Dynamo's graphs, compiled once per concrete shape.

TorchNeuron lowers each Dynamo graph to StableHLO and compiles it with neuronx-cc. Here each
graph compiles at its first call with one of three compilers (compile/static.py): the default
runs AOTAutograd's graphs through the neuron eager path, `NEURONLOCAL_COMPILER=inductor`
compiles stock Inductor CPU code run on zero-copy aliases, `tiered` starts as the default
and switches to Inductor's code for graphs that keep being called (compile/tiered.py);
graphs with tensor-subclass inputs (DTensor) are desugared first (compile/subclass.py).

Trainium's rules: `dynamic=True` is rejected; every concrete shape compiles its own static
graph. When Dynamo's automatic dynamic shapes (or `mark_dynamic`) hand the backend a
symbolic graph, it is specialised per concrete shape at run time, and the record says so.
Modes other than "default" warn once and act as default.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from neuronlocal.compile.static import (
    NEFFCompilationError,
    compile_eager,
    compile_static,
    on_neuron,
)
from neuronlocal.compile.subclass import compile_desugared, has_subclass
from neuronlocal.compile.tiered import TieredGraph
from neuronlocal.core import dryrun
from neuronlocal.core import dynamo_metrics as metrics
from neuronlocal.core.config import env_compiler, env_flag
from neuronlocal.device import check_available

_warned: set[str] = set()


class NeuronDynamicShapesError(NEFFCompilationError):
    """dynamic=True was requested; Trainium compiles static shapes only."""


def _warn_once(key: str, message: str) -> None:
    """Warns once, at the line of the user's program that compiled (not this file)."""
    if key not in _warned:
        _warned.add(key)
        frame = metrics.user_frame()
        if frame is None:
            warnings.warn(message, stacklevel=3)
        else:
            warnings.warn_explicit(message, UserWarning, frame["file"], frame["line"])


def _placeholder_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes
            if n.op == "placeholder"]


def _is_symbolic(x: Any) -> bool:
    if isinstance(x, torch.SymInt):
        return True
    return isinstance(x, torch.Tensor) and any(
        isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride()))


class _Specializer:
    """Compiles a Dynamo graph at its first call, once per concrete shape.

    Compiling with the real inputs of the call, outside Dynamo's tracing context, keeps
    Dynamo's fake tensors and shape symbols (all on neuron) out of Inductor's CPU compile.
    A static graph has no symbolic positions and so compiles exactly once; a symbolic one
    (Dynamo's automatic dynamic shapes, `mark_dynamic`) compiles once per new shape, as
    on Trainium.
    """

    def __init__(self, gm: fx.GraphModule, options: dict[str, Any]) -> None:
        self.gm = gm
        self.options = options
        self.positions = [i for i, v in enumerate(_placeholder_values(gm)) if _is_symbolic(v)]
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # Which Dynamo frame compile ("frame/attempt") made this graph: lets the run report
        # group the graphs of one function and attach Dynamo's recompile reason.
        cid = torch._guards.CompileContext.current_compile_id()
        self.extra = {"compile_id": str(cid)} if cid is not None else {}
        self.extra.update(metrics.graph_facts(gm))  # input names, training, user's line
        self.names: dict[tuple[Any, ...], str] = {}
        if self.positions:
            _warn_once("symbolic", "neuron compiles static shapes: a graph with dynamic "
                       "dimensions (Dynamo's automatic dynamic shapes or mark_dynamic) is "
                       "compiled once per concrete shape, as on Trainium. Set "
                       "torch._dynamo.config.automatic_dynamic_shapes = False (as TorchNeuron's "
                       "guide does) and pad inputs to a few sizes "
                       "(neuronlocal.compile.bucketing.pad_to_bucket) to bound compiles.")

    def _compile(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        kind = "specialized" if self.positions else "static"
        compiler = env_compiler()
        if compiler != "inductor" and on_neuron(self.gm, args):
            if compiler == "tiered" and not has_subclass(args) and not dryrun.enabled():
                return TieredGraph(self.gm, args, self.options, kind, self.extra)
            return compile_eager(self.gm, args, self.options, kind, self.extra)
        if has_subclass(args):
            return compile_desugared(self.gm, args, self.options, kind, self.extra)
        return compile_static(self.gm, list(args), self.options, kind=kind, extra=self.extra)

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else a
                    for a in (args[i] for i in self.positions))
        fn = self.compiled.get(key)
        if fn is None:
            before = metrics.next_graph_id()
            # As Dynamo compiles: with the ambient dispatch modes off (selective activation
            # checkpointing's caching mode, FlopCounterMode, ...), which must see the
            # compiled call, never AOTAutograd's or Inductor's tracing of it.
            with _disable_current_modes():
                fn = self._compile(args)
            self.compiled[key] = fn
            self.names[key] = (metrics.last_graph_name() if metrics.next_graph_id() > before
                               else "eager_fallback")
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args)
        # A named range per call, so compiled graphs appear in torch.profiler traces.
        with torch.profiler.record_function(f"neuron_graph::{self.names[key]}"):
            return fn(*args)


def neuron_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The Dynamo backend registered as "neuron" (entry point `torch_dynamo_backends`)."""
    check_available()
    options = dict(options or {})
    if mode and mode != "default":
        _warn_once(f"mode:{mode}", f"torch.compile mode={mode!r} is not supported on neuron; "
                   "compiling with the default mode (TorchNeuron ignores other modes too).")
    if not torch._dynamo.config.assume_static_by_default:
        raise NeuronDynamicShapesError(
            "torch.compile(dynamic=True) is not supported by the neuron backend: Trainium compiles "
            "static shapes and every new shape compiles once. Use dynamic=False (or leave it "
            "unset) and pad inputs to a few sizes (neuronlocal.compile.bucketing.pad_to_bucket).")
    if env_flag("TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY"):
        for i, x in enumerate(example_inputs):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                raise NEFFCompilationError(
                    f"input {i} of the compiled graph is a CPU tensor of shape {tuple(x.shape)}; "
                    "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY=1 forbids copying it to neuron. "
                    "Move it with .to('neuron') before the call.")
    return _Specializer(gm, options)

