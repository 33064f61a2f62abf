"""One static graph compiled for neuron, with either compiler, with its cache entry and record.

- The default compiler (`NEURONLOCAL_COMPILER=eager`, `compile_eager`): AOTAutograd's forward
  and backward graphs run through the neuron eager path (compile/aot.py).
- Inductor (`compile_static`): a copy of the Dynamo graph has its device constants rewritten
  from neuron to cpu and is compiled on CPU aliases of the inputs, so Inductor and
  AOTAutograd (and their caches) see exactly a CPU compile. The compiled function runs
  through `bridge.CompiledGraph`, which hands it aliases of the neuron tensors and adopts its
  outputs, with autograd crossing at the Function level (docs/architecture.md).

A graph that fails to compile raises NEFFCompilationError
(TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1, the default) or runs eagerly with a warning (=0).
The backend (compile/backend.py) decides which graph compiles when, and how.
"""

from __future__ import annotations

import copy
import logging
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from neuronlocal import _C
from neuronlocal.compile.aot import autocopied, compile_parts
from neuronlocal.compile.bridge import CompiledGraph, output_devices
from neuronlocal.compile.cache import (
    NeffCache,
    State,
    add_compiled_cache_key,
    graph_key,
    inductor_dirs,
)
from neuronlocal.compile.fingerprint import graph_text
from neuronlocal.compile.flex import decompose as decompose_flex
from neuronlocal.compile.lowering import lowering_fixes, optlevel_patches, stock_compile_fx
from neuronlocal.compile.megacache import COMPILATION_CACHE
from neuronlocal.core import dynamo_metrics as metrics
from neuronlocal.core.config import env_flag
from neuronlocal.estimate import capture as estimate_capture

log = logging.getLogger("neuronlocal.compile")
_NEURON = re.compile(r"^neuron(:\d+)?$")
_CACHE = NeffCache()


class NEFFCompilationError(RuntimeError):
    """A graph failed to compile for neuron (TorchNeuron's exception name)."""


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
    """torch.histc with neuron's device semantics (integer inputs allowed, as on device)."""
    from neuronlocal.eager.overrides import histc_host

    return histc_host(x, bins, min, max)


def _host(val: Any) -> Any:
    """A graph attribute as the CPU graph sees it: neuron tensors become CPU aliases."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if isinstance(val, torch.Tensor) and val.device.type == "neuron":
        with unset_fake_temporarily():  # a real constant, seen inside AOTAutograd's fake mode
            alias = _C._cpu_alias(val.detach())
        if isinstance(val, torch.nn.Parameter):
            return torch.nn.Parameter(alias, requires_grad=val.requires_grad)
        return alias
    return val


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


def cpu_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A CPU copy of `gm` for Inductor: device constants neuron -> cpu, neuron tensor
    attributes -> CPU aliases, ops whose device kernel accepts more than the CPU kernel
    -> their wider host version, and FlexAttention -> its ATen ops (compile/flex.py); the
    bodies of higher-order ops (score_mod, mask_mod, cond branches) are copied the same way.

    Only the graph is copied; attributes are shared (as aliases), never deep-copied: that
    would copy every weight, and inside AOTAutograd's fake mode (the graphs of a desugared
    subclass graph) a copied tensor constant becomes a meta tensor that cannot take the
    neuron storage (a KV cache's empty tensors are such constants)."""
    graph = copy.deepcopy(gm.graph)  # nodes are copied; their meta and tensors are shared
    root = torch.nn.Module()
    for node in graph.nodes:
        node.args, node.kwargs = _cpu(node.args), _cpu(node.kwargs)
        if node.op == "call_function" and node.target in (torch.histc, torch.ops.aten.histc,
                                                          torch.ops.aten.histc.default):
            node.target = _histc
        elif node.op == "call_method" and node.target == "histc":
            node.op, node.target = "call_function", _histc
        if node.op in ("get_attr", "call_module"):
            owner, _, name = node.target.rpartition(".")
            parent = root
            for part in owner.split(".") if owner else []:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            val = gm.get_submodule(owner) if owner else gm
            val = getattr(val, name)
            if isinstance(val, fx.GraphModule):  # a body of a higher-order op: also copied
                parent.add_module(name, cpu_copy(val))
            elif isinstance(val, torch.nn.Module):
                parent.add_module(name, val)
            else:
                setattr(parent, name, _host(val))
    decompose_flex(graph)  # Inductor's CPU FlexAttention is inference-only
    out = fx.GraphModule(root, graph, class_name=type(gm).__name__)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def _example(x: Any, autograd: bool) -> Any:
    """A CPU example input for Inductor: an alias of a neuron tensor, keeping requires_grad
    when the compiled graph does its own autograd. Fake tensors (the plain graphs AOTAutograd
    makes of subclass graphs) stay as they are; `_compile_cpu` makes CPU fakes of them."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(x, FakeTensor):
        return x
    if isinstance(x, torch.Tensor) and x.device.type == "neuron":
        alias = _C._cpu_alias(x.detach())
        grad = autograd and x.requires_grad and (x.is_floating_point() or x.is_complex())
        return alias.requires_grad_(True) if grad else alias
    return x if autograd or not isinstance(x, torch.Tensor) else x.detach()


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type, x.requires_grad)
    if isinstance(x, torch.SymInt):
        return ("symint",)
    return type(x).__name__ if not isinstance(x, (int, float, bool)) else x


def _fallback_allowed(options: dict[str, Any]) -> bool:
    if "fallback_execution" in options:
        return bool(options["fallback_execution"])
    return not env_flag("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION")


def _graph_name(gm: fx.GraphModule, model_name: str | None, graph_id: int) -> str:
    base = model_name or getattr(gm, "_neuron_name", None) or "graph"
    return f"{base}_{graph_id}"


def _cache_counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return (counters["aot_autograd"]["autograd_cache_hit"],
            counters["inductor"]["fxgraph_cache_hit"])


def _compile_cpu(cpu_gm: fx.GraphModule, examples: list[Any],
                 config_patches: dict[str, Any] | None) -> Callable[..., Any]:
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # As under Dynamo: fake inputs from a mode with a shape environment, inside a tracing
    # context. Inductor's and AOTAutograd's caches need both (a bare compile bypasses them).
    # Shapes are static: every size is a plain integer.
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(x: Any) -> Any:
        if isinstance(x, FakeTensor):  # a fake of another mode, on neuron: same layout on CPU
            with fake_mode:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
        return fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x

    fakes = [fake(x) for x in examples]
    # Placeholders that carry a fake value (graphs AOTAutograd made) describe CPU inputs now:
    # Inductor reads them as the inputs when it builds one C++ file per graph (-O1).
    placeholders = [n for n in cpu_gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, fakes, strict=False):
        if isinstance(node.meta.get("val"), torch.Tensor) and isinstance(x, torch.Tensor):
            node.meta["val"] = x
    # The backward compiles with the forward, under the graph's lock, so a concurrent
    # process finds a complete cache entry and never compiles the same backward again.
    # Random ops run ATen's kernels (`fallback_random`): TorchNeuron draws a compiled graph's
    # random masks outside it with the eager generator, so a seed gives eager's numbers.
    with tracing(TracingContext(fake_mode)), lowering_fixes(), \
            functorch_config.patch(force_non_lazy_backward_lowering=True), \
            inductor_config.patch(fallback_random=True):
        return stock_compile_fx()(cpu_gm, fakes, config_patches=config_patches or None)


def compile_failed(err: Exception, name: str, nodes: int, options: dict[str, Any]) -> None:
    """Raises NEFFCompilationError for a graph that failed to compile, or warns that it runs
    eagerly (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=0)."""
    if isinstance(err, NEFFCompilationError) or not _fallback_allowed(options):
        raise NEFFCompilationError(
            f"neuron could not compile graph {name!r} ({nodes} nodes): "
            f"{type(err).__name__}: {err}. Set TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=0"
            " to run failing graphs eagerly instead.") from err
    warnings.warn(f"neuron could not compile graph {name!r} ({type(err).__name__}: "
                  f"{err}); running it eagerly (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
                  "=0).", stacklevel=3)


def _has_collectives(gm: fx.GraphModule) -> bool:
    return any("c10d" in str(getattr(n.target, "namespace", n.target))
               for n in gm.graph.nodes if n.op == "call_function")


def _record(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any],
            graph_id: int, name: str, seconds: float, cache_state: str, key: str, kind: str,
            extra: dict[str, Any], text: str) -> str:
    """Records the compiled graph (its key, its bytes, its metrics record); returns its cache
    state: a graph of the eager compiler whose bytes a MegaCache load put in the persistent
    cache is a hit, as a loaded NEFF is on Trainium."""
    compiler = extra.get("compiler", "eager")
    if COMPILATION_CACHE.compiled(key, name, compiler, text, seconds) and compiler == "eager":
        cache_state = "hit"
    add_compiled_cache_key(key)
    shapes = [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
    dtypes = [str(x.dtype) for x in example_inputs if isinstance(x, torch.Tensor)]
    metrics.record(metrics.GraphRecord(graph_id, name, options.get("model_name"),
                                       len(gm.graph.nodes), shapes, dtypes, seconds, cache_state,
                                       key, _has_collectives(gm), kind, extra))
    return cache_state


def compile_eager(gm: fx.GraphModule, args: Sequence[Any], options: dict[str, Any],
                  kind: str = "static", extra: dict[str, Any] | None = None
                  ) -> Callable[..., Any]:
    """Compiles one static graph with the default compiler (compile/aot.py: AOTAutograd's
    graphs run through the neuron eager path), with its cache entry and metrics record."""
    graph_id = metrics.next_graph_id()
    name = _graph_name(gm, options.get("model_name") or metrics.get_model_name(), graph_id)
    copies = autocopied(args)
    # Dynamo guards on devices: a graph compiled without CPU inputs never gets one later.
    moved = any(a is not b for a, b in zip(args, copies, strict=True))
    args = copies
    flags = {"grad": torch.is_grad_enabled(), "compiler": "eager"}
    text = graph_text(gm)
    key = graph_key(text, [_meta(x) for x in args], flags)
    start = time.perf_counter()
    try:
        fn, parts = compile_parts(gm, args)
    except Exception as err:
        compile_failed(err, name, len(gm.graph.nodes), options)
        return gm.forward
    cache_state = _record(gm, args, options, graph_id, name, time.perf_counter() - start,
                          _CACHE.mark(key, name), key, kind,
                          {**(extra or {}), "compiler": "eager", "parts": parts}, text)
    log.debug("compiled %s (%d nodes; parts %s), cache %s", name, len(gm.graph.nodes), parts,
              cache_state)

    def run(*call_args: Any) -> Any:
        return fn(*autocopied(call_args))

    return estimate_capture.attach(gm, args, run if moved else fn)


def _compile_cached(key: str, name: str, state: State, cpu_gm: fx.GraphModule,
                    examples: list[Any], patches: dict[str, Any], grad: bool
                    ) -> tuple[Callable[..., Any], str]:
    """Compiles `cpu_gm` with Inductor, through the persistent cache as `state` allows;
    returns the compiled function and "hit" or "miss"."""
    with _CACHE.claim(key, state) as entry:
        cacheable = state.mode == "rw" or entry is not None
        before = _CACHE.snapshot(state) if state.mode == "rw" and entry is None else None
        hits = _cache_counters()
        with inductor_dirs(_CACHE, state, cacheable), torch.set_grad_enabled(grad):
            fn = _compile_cpu(cpu_gm, examples, patches)
        cache_state = "miss" if _cache_counters() == hits else "hit"
        if before is not None:
            _CACHE.store(key, name, before, state)
    return fn, cache_state


@dataclass
class InductorJob:
    """What Inductor compiles for one static graph: its CPU copy, CPU example inputs, the
    config patches and grad mode, and the persistent-cache key they make."""

    key: str
    cpu_gm: fx.GraphModule
    examples: list[Any]
    patches: dict[str, Any]
    grad: bool
    text: str = ""  # the CPU graph's text (`fingerprint.graph_text`), the key's IR


def inductor_job(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any],
                 autograd: bool = True) -> InductorJob:
    """The Inductor compile of `gm` for these inputs, before it runs (see InductorJob)."""
    cpu_gm = cpu_copy(gm)
    examples = [_example(x, autograd) for x in example_inputs]
    # The optimisation level's settings, then the caller's own (mode, options) over them.
    patches = {**optlevel_patches(), **(options.get("config_patches") or {})}
    grad = autograd and torch.is_grad_enabled()
    flags: dict[str, Any] = {"grad": grad, "patches": repr(sorted((patches or {}).items()))}
    if not autograd:  # a part of a desugared graph: its bridge never enters autograd
        flags["bridge"] = "plain"
    text = graph_text(cpu_gm)
    key = graph_key(text, [_meta(x) for x in example_inputs], flags)
    return InductorJob(key, cpu_gm, examples, patches, grad, text)


def run_inductor_job(job: InductorJob, name: str, state: State | None = None) -> str:
    """Compiles `job` through the persistent cache (the background compiler's entry point:
    it fills the cache a later `inductor_graph` of the same graph loads from); "hit"/"miss"."""
    return _compile_cached(job.key, name, state or _CACHE.state(), job.cpu_gm, job.examples,
                           job.patches, job.grad)[1]


def inductor_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], name: str,
                   job: InductorJob) -> tuple[Callable[..., Any], str]:
    """`job` compiled (or taken from the memory or disk cache) and bridged to neuron: the
    compiled function and "hit" or "miss". Raises what the compile raises."""
    compiled = _CACHE.memory.get(job.key)
    if compiled is not None:
        return compiled, "hit"
    state = _CACHE.state()
    try:
        fn, cache_state = _compile_cached(job.key, name, state, job.cpu_gm, job.examples,
                                          job.patches, job.grad)
    except Exception as err:
        if not _CACHE.give_up(err, state):  # a cache that cannot be written: without
            raise
        state = State("off")
        fn, cache_state = _compile_cached(job.key, name, state, cpu_copy(gm), job.examples,
                                          job.patches, job.grad)
    compiled = CompiledGraph(fn, output_devices(gm), example_inputs, job.grad)
    if state.mode != "off":
        _CACHE.memory[job.key] = compiled
    return compiled, cache_state


def compile_static(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any],
                   kind: str = "static", extra: dict[str, Any] | None = None,
                   autograd: bool = True) -> Callable[..., Any]:
    """Compiles one static graph (or takes it from the cache) and records its metrics.
    `autograd=False`: the caller (AOTAutograd's runtime) handles gradients, so the graph
    compiles for inference and the bridge stays out of autograd."""
    graph_id = metrics.next_graph_id()
    name = _graph_name(gm, options.get("model_name") or metrics.get_model_name(), graph_id)
    nodes = len(gm.graph.nodes)
    job = inductor_job(gm, example_inputs, options, autograd)
    start = time.perf_counter()
    try:
        compiled, cache_state = inductor_graph(gm, example_inputs, name, job)
    except Exception as err:
        compile_failed(err, name, nodes, options)
        return gm.forward
    _record(gm, example_inputs, options, graph_id, name, time.perf_counter() - start,
            cache_state, job.key, kind, {**(extra or {}), "compiler": "inductor"}, job.text)
    log.debug("compiled %s (%d nodes), cache %s\n%s", name, nodes, cache_state, job.cpu_gm.code)
    # The Trainium-time estimate of this graph goes on its record, and its calls are counted
    # while `neuronlocal run` or `check` captures (neuronlocal.estimate.capture).
    return estimate_capture.attach(gm, example_inputs, compiled)
