"""torch.compile(backend="neuron"): Dynamo -> AOTAutograd -> Inductor C++ code on host memory.

TorchNeuron lowers graphs to StableHLO and neuronx-cc (spec 3.1). Here the graph is
compiled by stock Inductor for CPU (path B of DESIGN.md): device constants in the graph
are rewritten from neuron to cpu, Inductor compiles on CPU aliases of the example inputs,
and each compiled forward/backward runs through a zero-copy bridge (csrc/bridge.cpp):
neuron inputs in as CPU aliases, CPU outputs adopted as neuron tensors. AOTAutograd's
runtime stays on neuron tensors, so autograd, parameters and gradients never leave neuron.

Trainium rules (spec 3.2): `dynamic=True` is rejected; graphs are static, and when
Dynamo's automatic dynamic shapes hands us a symbolic graph it is specialised per concrete
shape at run time, so every new shape compiles once. Modes other than "default" warn once
and act as default. A graph that fails to compile raises (TORCH_NEURONX_DISABLE_FALLBACK_
EXECUTION, default 1) or runs eagerly with a warning (set to 0).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from neuronlocal import _C
from neuronlocal.compile import metrics
from neuronlocal.compile.cache import NeffCache, disabled, graph_key

log = logging.getLogger("neuronlocal.compile")
_NEURON = re.compile(r"^neuron(:\d+)?$")
_CACHE = NeffCache()
_warned_modes: set[str] = set()


class NEFFCompilationError(RuntimeError):
    """A graph failed to compile for neuron (TorchNeuron's exception name)."""


class NeuronDynamicShapesError(NEFFCompilationError):
    """dynamic=True was requested; Trainium compiles static shapes only."""


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _cpu(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == "neuron":
        return torch.device("cpu")
    if isinstance(a, str) and _NEURON.match(a):
        return "cpu"
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x) for x in a)
    if isinstance(a, dict):
        return {k: _cpu(v) for k, v in a.items()}
    return a


def _histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """torch.histc with the device semantics of eager/overrides.py (integer inputs allowed)."""
    if x.is_floating_point():
        return torch.histc(x, bins, min, max)
    return torch.histc(x.double(), bins, min, max).to(x.dtype)


def rewrite_to_cpu(gm: fx.GraphModule) -> fx.GraphModule:
    """Device constants neuron -> cpu, neuron tensor attributes -> CPU aliases, and ops whose
    device kernel accepts more than the CPU kernel -> their wider host version."""
    for node in gm.graph.nodes:
        node.args, node.kwargs = _cpu(node.args), _cpu(node.kwargs)
        if node.op == "call_function" and node.target in (torch.histc, torch.ops.aten.histc,
                                                          torch.ops.aten.histc.default):
            node.target = _histc
        elif node.op == "call_method" and node.target == "histc":
            node.op, node.target = "call_function", _histc
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            val = getattr(mod, name, None)
            if isinstance(val, torch.Tensor) and val.device.type == "neuron":
                alias = _C._cpu_alias(val.detach())
                if isinstance(val, torch.nn.Parameter):
                    alias = torch.nn.Parameter(alias, requires_grad=val.requires_grad)
                setattr(mod, name, alias)
    gm.recompile()
    return gm


def _example(x: Any) -> Any:
    """A CPU example input for Inductor: an alias of a neuron tensor, keeping requires_grad."""
    if isinstance(x, torch.Tensor) and x.device.type == "neuron":
        alias = _C._cpu_alias(x.detach())
        return alias.requires_grad_(x.requires_grad) if x.is_floating_point() or x.is_complex() \
            else alias
    return x


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type, x.requires_grad)
    if isinstance(x, torch.SymInt):
        return ("symint",)
    return type(x).__name__ if not isinstance(x, (int, float, bool)) else x


class _Bridged:
    """An Inductor OutputCode called on CPU aliases, returning neuron tensors."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # An instance attribute, so wrappers made with functools.wraps (AOTAutograd wraps the
        # backward in torch._dynamo.disable) still see the boxed calling convention.
        self._boxed_call = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *call_args: Any) -> list[Any]:
        # AOTAutograd calls boxed (one list it hands over) or unboxed (positional) code.
        boxed = len(call_args) == 1 and isinstance(call_args[0], list)
        args = call_args[0] if boxed else list(call_args)
        cpu_args, index = _C._bridge_in(args)
        if boxed:
            args.clear()
        outs = self.inner(cpu_args)
        return _C._bridge_out(list(outs), index)


def _bridged_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    return _Bridged(compile_fx_inner(gm, example_inputs, **kwargs))


@contextlib.contextmanager
def _inductor_cache_in_neff_dir() -> Iterator[None]:
    """Points Inductor's caches into the NEFF cache dir, or disables them with it.

    AOTAutograd's own cache stays off: a hit there would skip our bridged inner compiler.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    user_dir = os.environ.get("NEURONLOCAL_USER_INDUCTOR_CACHE_DIR")
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = user_dir or str(_CACHE.inductor_dir)
    try:
        with inductor_config.patch(force_disable_caches=disabled()), \
                functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _fallback_allowed(options: dict[str, Any]) -> bool:
    if "fallback_execution" in options:
        return bool(options["fallback_execution"])
    return not _flag("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", True)


def _graph_name(gm: fx.GraphModule, model_name: str | None, graph_id: int) -> str:
    base = model_name or getattr(gm, "_neuron_name", None) or "graph"
    return f"{base}_{graph_id}"


def compile_static(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any],
                   kind: str = "static", extra: dict[str, Any] | None = None
                   ) -> Callable[..., Any]:
    """Compiles one static graph (or returns it from the cache) and records its metrics."""
    from torch._inductor.compile_fx import compile_fx

    original = gm
    graph_id = metrics.next_graph_id()
    name = _graph_name(gm, options.get("model_name") or metrics.get_model_name(), graph_id)
    nodes = len(gm.graph.nodes)
    collectives = any("c10d" in str(getattr(n.target, "namespace", n.target))
                      for n in gm.graph.nodes if n.op == "call_function")
    cpu_gm = rewrite_to_cpu(copy.deepcopy(gm))
    examples = [_example(x) for x in example_inputs]
    key = graph_key(cpu_gm.code, [_meta(x) for x in example_inputs],
                    {"grad": torch.is_grad_enabled()})
    start = time.perf_counter()
    cache_state = "miss"
    compiled = None if disabled() else _CACHE.memory.get(key)
    if compiled is not None:
        cache_state = "hit"
    else:
        try:
            with _CACHE.lock(key):
                entry = _CACHE.lookup(key)
                before = _CACHE.snapshot() if entry is None and not disabled() else set()
                with _inductor_cache_in_neff_dir():
                    compiled = compile_fx(cpu_gm, examples, inner_compile=_bridged_inner)
                if entry is None:
                    _CACHE.store(key, name, before)
                else:
                    cache_state = "hit"
        except Exception as err:
            if isinstance(err, NEFFCompilationError) or not _fallback_allowed(options):
                raise NEFFCompilationError(
                    f"neuron could not compile graph {name!r} ({nodes} nodes): "
                    f"{type(err).__name__}: {err}. Set TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=0"
                    " to run failing graphs eagerly instead.") from err
            warnings.warn(f"neuron could not compile graph {name!r} ({type(err).__name__}: "
                          f"{err}); running it eagerly (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
                          "=0).", stacklevel=2)
            return original.forward
        if not disabled():
            _CACHE.memory[key] = compiled
    seconds = time.perf_counter() - start
    shapes = [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
    dtypes = [str(x.dtype) for x in example_inputs if isinstance(x, torch.Tensor)]
    metrics.record(metrics.GraphRecord(graph_id, name, options.get("model_name"), nodes, shapes,
                                       dtypes, seconds, cache_state, key, collectives, kind,
                                       dict(extra or {})))
    log.debug("compiled %s (%d nodes) in %.2fs, cache %s\n%s", name, nodes, seconds,
              cache_state, cpu_gm.code)
    return compiled


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
    (Dynamo's automatic dynamic shapes) compiles once per new shape, as on Trainium.
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
        self.names: dict[tuple[Any, ...], str] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else a
                    for a in (args[i] for i in self.positions))
        fn = self.compiled.get(key)
        if fn is None:
            kind = "specialized" if self.positions else "static"
            before = metrics.next_graph_id()
            fn = compile_static(self.gm, list(args), self.options, kind=kind, extra=self.extra)
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
    options = dict(options or {})
    if mode and mode != "default" and mode not in _warned_modes:
        _warned_modes.add(mode)
        warnings.warn(f"torch.compile mode={mode!r} is not supported on neuron; compiling with "
                      "the default mode (TorchNeuron ignores other modes too).", stacklevel=2)
    if not torch._dynamo.config.assume_static_by_default:
        raise NeuronDynamicShapesError(
            "torch.compile(dynamic=True) is not supported by the neuron backend: Trainium compiles "
            "static shapes and every new shape compiles once. Use dynamic=False (or leave it "
            "unset) and pad inputs to a few sizes (neuronlocal.compile.bucketing.pad_to_bucket).")
    if _flag("TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY", False):
        for i, x in enumerate(example_inputs):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                raise NEFFCompilationError(
                    f"input {i} of the compiled graph is a CPU tensor of shape {tuple(x.shape)}; "
                    "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY=1 forbids copying it to neuron. "
                    "Move it with .to('neuron') before the call.")
    return _Specializer(gm, options)
