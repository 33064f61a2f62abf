"""The default compile stage: AOTAutograd's graphs, run by the neuron eager path.

TorchNeuron hands AOTAutograd's forward and backward graphs to neuronx-cc. Here they run op
by op on neuron tensors through the same dispatch as eager mode: op placement, CPU-fallback
tracking, the 64-bit rule, HBM accounting and random ops drawing from CPU's global generator
(compiled dropout draws what eager draws). A compile therefore costs Dynamo's trace plus
AOTAutograd's, with no code generation and no C++ build. Tensor subclasses (DTensor) are
desugared by the same AOTAutograd call, so their graphs run on the inner neuron tensors.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx


def _neuron_rng_wrappers() -> None:
    """Activation checkpointing under compile: AOTAutograd's partitioner replays a
    checkpointed region's random ops in the backward with the generator state the forward
    saw, through two wrappers (`run_and_save_rng_state`, `run_with_rng_state`) that know
    CPU, CUDA, HPU and XPU only. Random ops on neuron draw from CPU's global generator (as
    TorchNeuron's CPU fallback does), so on neuron the wrappers save and restore CPU's
    state, in the three places they dispatch: at run time, on fake tensors, and while
    AOTAutograd traces."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch._prims import rng_prims
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, track_tensor_tree
    from torch.utils import _pytree as pytree

    save, replay = rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state
    if getattr(save, "_neuronlocal", False):
        return

    def on_neuron(args: Any, kwargs: Any) -> bool:
        return rng_prims.get_device(args, kwargs) == "neuron"

    def save_neuron(op: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.get_rng_state(), op(*args, **kwargs)

    def replay_neuron(rng_state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state.cpu())
        try:
            return op(*args, **kwargs)
        finally:
            torch.set_rng_state(current)

    stock_save = save.py_kernels[DispatchKey.BackendSelect]
    stock_replay = replay.py_kernels[DispatchKey.BackendSelect]
    stock_fake = registered_hop_fake_fns[save]
    stock_proxy = save.python_key_table[ProxyTorchDispatchMode]

    def save_backend(op: Any, *args: Any, **kwargs: Any) -> Any:
        fn = save_neuron if on_neuron(args, kwargs) else stock_save
        return fn(op, *args, **kwargs)

    def replay_backend(rng_state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        fn = replay_neuron if on_neuron(args, kwargs) else stock_replay
        return fn(rng_state, op, *args, **kwargs)

    def save_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        fn = save_neuron if on_neuron(args, kwargs) else stock_fake
        return fn(op, *args, **kwargs)

    def save_proxy(mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not on_neuron(args, kwargs):
            return stock_proxy(mode, op, *args, **kwargs)
        out = save_neuron(op, *args, **kwargs)
        proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, (op, *args))
        proxy_kwargs = pytree.tree_map(mode.tracer.unwrap_proxy, kwargs)
        proxy = mode.tracer.create_proxy("call_function", save, proxy_args, proxy_kwargs)
        return track_tensor_tree(out, proxy, constant=None, tracer=mode.tracer)

    save.py_kernels[DispatchKey.BackendSelect] = save_backend
    replay.py_kernels[DispatchKey.BackendSelect] = replay_backend
    registered_hop_fake_fns[save] = save_fake
    save.python_key_table[ProxyTorchDispatchMode] = save_proxy
    for hop in (save, replay):
        hop._dispatch_cache.clear()
    save._neuronlocal = True


def _layout_free_views(gm: fx.GraphModule) -> bool:
    """Views of the ATen graph become reshapes. The graph's strides come from the trace
    (meta kernels and decompositions), and a CPU kernel may return another layout for the
    same inputs (softplus_backward keeps its gradient's transposed layout where the trace
    says contiguous), so a traced `view` can fail at run time. The graphs are functional
    (no op mutates an intermediate, AOTAutograd rebuilds aliased outputs itself), so a
    reshape is the same computation: a view where the layout allows, else a copy. One with a
    size-1 dim also keeps the traced strides (`_reshape_as_traced`)."""
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in views:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and 1 in val.shape:
                node.target = _reshape_as_traced
                node.args = (node.args[0], node.args[1], tuple(val.stride()))
            else:
                node.target = torch.ops.aten.reshape.default
            changed = True
    return changed


def _reshape_as_traced(x: torch.Tensor, shape: Sequence[int], stride: tuple[int, ...]
                       ) -> torch.Tensor:
    """`x.reshape(shape)` with the traced strides where only the strides of size-1 dims
    differ (they address nothing, but a kernel's layout check reads them: CPU's group norm
    refuses a channels-last input whose batch-1 stride is not the one the trace assumed when
    it left out the `contiguous()`)."""
    y = torch.reshape(x, shape)
    got = y.stride()
    if got == stride or not all(a == b or n == 1 for a, b, n in zip(got, stride, y.shape,
                                                                        strict=True)):
        return y
    return y.as_strided(y.shape, stride, y.storage_offset())


def _aliases(node: fx.Node) -> bool:
    """Whether `node` may return a view of its inputs (anything but a plain ATen op that
    returns new tensors counts as one)."""
    target = node.target
    return node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
        or any(r.alias_info is not None for r in target._schema.returns)


def _reaches_output(node: fx.Node) -> bool:
    """Whether `node`'s value, or a view of it, is an output of the graph."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user not in seen and _aliases(user):
                seen.add(user)
                todo.append(user)
    return False


def _updated_in_place(gm: fx.GraphModule) -> bool:
    """An inference graph's input updates run in place. Functionalisation turns
    `cache.index_copy_(...)` into `new = index_copy(cache, ...)` plus a final
    `cache.copy_(new)`: a full copy of the input and a second buffer its size per call (a
    static KV cache, twice per layer per decode step). Trainium aliases such an output to its
    input; here the op becomes its in-place variant and the copy goes, where nothing else
    reads the input after the op, no view of the input exists, the result (or a view of it)
    is not a graph output, and it has the input's shape, dtype and strides."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    changed = False
    for copy in nodes:
        if copy.op != "call_function" or copy.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = copy.args[0], copy.args[1]
        if not (isinstance(dst, fx.Node) and dst.op == "placeholder" and isinstance(src, fx.Node)
                and src.op == "call_function" and src.args and src.args[0] is dst
                and not copy.kwargs and not _reaches_output(src)):
            continue
        target = src.target
        if _aliases(src) or not isinstance(target, torch._ops.OpOverload):
            continue
        packet = getattr(torch.ops.aten, target.__name__.split(".")[0] + "_", None)
        inplace = getattr(packet, target._overloadname, None) if packet is not None else None
        if inplace is None:
            continue
        new, old = src.meta.get("val"), dst.meta.get("val")
        if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                and new.shape == old.shape and new.dtype == old.dtype
                and new.stride() == old.stride()):
            continue
        others = [u for u in dst.users if u is not src and u is not copy]
        if any(order[u] > order[src] or _aliases(u) for u in others) \
                or dst in (*src.args[1:], *src.kwargs.values()):
            continue
        src.target = inplace
        copy.replace_all_uses_with(src)
        gm.graph.erase_node(copy)
        changed = True
    return changed


def _repeated_kv(node: Any) -> tuple[fx.Node, int] | None:
    """`(kv, n)` when `node` is `repeat_kv(kv, n)` as AOTAutograd traces it (unsqueeze at 2,
    expand to n copies, a contiguous copy, a view that merges the copies into the heads), each
    step used only by the next."""
    a = torch.ops.aten
    chain = [(a.view.default, a._unsafe_view.default), (a.clone.default,),
             (a.expand.default,), (a.unsqueeze.default,)]
    n = node
    for i, targets in enumerate(chain):
        if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets
                and (i == 0 or len(n.users) == 1)):
            return None
        if n.target is a.unsqueeze.default and n.args[1] != 2:
            return None
        n = n.args[0]
    kv, rep = _val(n), _val(node.args[0].args[0])
    if not (isinstance(n, fx.Node) and isinstance(kv, torch.Tensor) and kv.dim() == 4
            and isinstance(rep, torch.Tensor) and rep.dim() == 5):
        return None
    return n, int(rep.shape[2])


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _packed_gqa(gm: fx.GraphModule) -> bool:
    """Decode attention of a grouped-query model runs on the key/value heads, as eager mode
    runs it. For one query token, transformers' eager SDPA folds the query heads of each
    key/value head into the query length (`pack_gqa`) but, while Dynamo traces, repeats the
    key and value cache for every query head instead (`repeat_kv`): two copies of the whole
    cache per layer per decode step, which eager mode never makes. Here the query is folded the same
    way (and the mask with it), the attention reads the cache as it is, and the output is
    unfolded: the same computation as eager mode's."""
    a = torch.ops.aten
    sdpa = a._scaled_dot_product_flash_attention_for_cpu.default
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not sdpa:
            continue
        q, k, v = node.args[:3]
        rest = node.args[3:]
        if any(rest) or set(node.kwargs) - {"attn_mask", "scale"}:
            continue  # dropout or is_causal
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in node.users):
            continue  # the logsumexp is used (a backward)
        kr, vr = _repeated_kv(k), _repeated_kv(v)
        qv, mask = _val(q), node.kwargs.get("attn_mask")
        if kr is None or vr is None or k is v or kr[1] != vr[1] \
                or not isinstance(qv, torch.Tensor):
            continue
        (kv_k, n), (kv_v, _) = kr, vr
        batch, heads, length, dim = qv.shape
        mv = _val(mask)
        if length != 1 or heads != _val(kv_k).shape[1] * n or (
                mask is not None and not (isinstance(mv, torch.Tensor) and mv.dim() == 4
                                          and mv.shape[1] in (1, heads))):
            continue
        groups = heads // n
        with gm.graph.inserting_before(node):
            packed_q = gm.graph.call_function(a.reshape.default, (q, [batch, groups, n, dim]))
            kwargs = dict(node.kwargs)
            if mask is not None and mv.shape[1] == heads:
                kwargs["attn_mask"] = gm.graph.call_function(
                    a.reshape.default, (mask, [mv.shape[0], groups, n, mv.shape[3]]))
            att = gm.graph.call_function(sdpa, (packed_q, kv_k, kv_v), kwargs)
            out = gm.graph.call_function(operator.getitem, (att, 0))
            unpacked = gm.graph.call_function(a.reshape.default, (out, [batch, heads, 1, dim]))
        for user in list(node.users):
            user.replace_all_uses_with(unpacked)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        for start in (k, v):  # the repeat chains, now unused
            n_ = start
            while isinstance(n_, fx.Node) and not n_.users and n_ not in (kv_k, kv_v):
                nxt = n_.args[0]
                gm.graph.erase_node(n_)
                n_ = nxt
        changed = True
    return changed


@functools.cache
def _bound_ops() -> dict[Any, tuple[Callable[..., Any], frozenset[str]]]:
    """ATen overload -> the public torch function that calls exactly it, and the keyword
    arguments both take. A graph node calls `torch.ops.aten.add.Tensor` through Python
    (`OpOverload.__call__`, then the generic dispatcher entry); `torch.add` enters the same
    kernel through its generated C++ binding, about 0.6 us sooner, which is a tenth of a
    small decode step of a few hundred nodes."""
    a = torch.ops.aten
    none: frozenset[str] = frozenset()
    return {
        a.add.Tensor: (torch.add, frozenset({"alpha"})),
        a.sub.Tensor: (torch.sub, frozenset({"alpha"})),
        a.mul.Tensor: (torch.mul, none), a.div.Tensor: (torch.div, none),
        a.mm.default: (torch.mm, none), a.bmm.default: (torch.bmm, none),
        a.addmm.default: (torch.addmm, frozenset({"beta", "alpha"})),
        a.t.default: (torch.t, none), a.reshape.default: (torch.reshape, none),
        a.transpose.int: (torch.transpose, none), a.permute.default: (torch.permute, none),
        a.unsqueeze.default: (torch.unsqueeze, none), a.squeeze.dim: (torch.squeeze, none),
        a.select.int: (torch.select, none), a.cat.default: (torch.cat, none),
        a.clone.default: (torch.clone, frozenset({"memory_format"})),
        a.where.self: (torch.where, none),
        a.pow.Tensor_Scalar: (torch.pow, none), a.mean.dim: (torch.mean, frozenset({"dtype"})),
        a.sum.dim_IntList: (torch.sum, frozenset({"dtype"})),
        a.rsqrt.default: (torch.rsqrt, none), a.neg.default: (torch.neg, none),
        a.exp.default: (torch.exp, none), a.tanh.default: (torch.tanh, none),
        a.sigmoid.default: (torch.sigmoid, none), a.cos.default: (torch.cos, none),
        a.sin.default: (torch.sin, none),
    }


def _bound_calls(gm: fx.GraphModule) -> bool:
    """Nodes of `_bound_ops()` call the public function instead (same kernel, same
    dispatch keys, so placement, fallbacks, the 64-bit rule and memory accounting see the
    same op)."""
    changed = False
    for node in gm.graph.nodes:
        bound = _bound_ops().get(node.target) if node.op == "call_function" else None
        if bound is not None and set(node.kwargs) <= bound[1]:
            node.target = bound[0]
            changed = True
    return changed


def _runner(part: str, sizes: dict[str, int]) -> Callable[..., Any]:
    def compile_part(inner: fx.GraphModule, examples: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import make_boxed_func

        sizes[part] = len(inner.graph.nodes)
        in_place = part == "inference" and _updated_in_place(inner)
        packed = part == "inference" and _packed_gqa(inner)
        reshaped = _layout_free_views(inner)
        if _bound_calls(inner) or reshaped or in_place or packed:
            inner.recompile()
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

    _neuron_rng_wrappers()
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
