"""What each ATen op asks of a NeuronCore: FLOPs per engine, HBM bytes, collective bytes.

Matmuls and convolutions (the ops `torch.utils.flop_counter` has formulas for) run on the
tensor engine; elementwise ops, reductions, softmax and copies on the vector and scalar
engines; views and allocations cost nothing. Bytes are what the op reads and writes, an
upper bound on HBM traffic that the calibrated fusion factor scales down for vector work.
On fake and meta tensors attention is one fused (flash) op, as Trainium's attention kernels
run it: its S x S scores stay on chip (on real tensors it is costed as the ops that run).
`Counter` is the dispatch mode that adds every op it sees to a `Tally`. Higher-order
operators (torch.cond, while_loop, invoke_subgraph, the RNG wrappers of activation
checkpointing, flex attention) are costed by their bodies, which run as they would without
the mode; one it does not know runs uncounted and is named in `Counter.uncounted`.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch._ops import HigherOrderOperator
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
_FREE = {aten._unsafe_view, aten.detach, aten.alias, aten.lift_fresh, aten.empty,
         aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
         aten._local_scalar_dense, aten.sym_size, aten.sym_stride, aten.sym_numel,
         aten.sym_storage_offset, aten.is_same_size}
# Functional-collective ops that move nothing: waits, and the autograd wrapper funcol puts
# around a collective's result (it was priced as a collective of the whole world).
_WAIT = {"wait_tensor", "_wait_tensor", "_wrap_tensor_autograd"}
_SDPA_OPS = {"_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable"}
# Ops that touch only part of a big operand: gathers read the rows they return, in-place
# scatters and copies write what they are given (a KV-cache update is not a cache copy).
_GATHERS = {"embedding", "index_select", "gather", "take"}
_SCATTERS = {"copy_", "index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_",
             "scatter_", "scatter", "index_add_", "slice_scatter", "select_scatter",
             "masked_scatter_", "index_fill_"}
VECTOR_OPS_PER_SCORE = 5  # max, subtract, exp, sum, scale per attention score (softmax)
# Higher-order operators whose bodies run inside them: the argument positions of the bodies.
# cond costs its costlier branch (a fake run traces both; a real one runs one).
_BODIES = {"cond": (1, 2), "while_loop": (0, 1), "while_loop_stack_output": (0, 1),
           "invoke_subgraph": (0,), "wrap": (0,), "wrap_with_set_grad_enabled": (1,)}
# The RNG wrappers of checkpointed regions run one ATen op: the position of that op.
_RNG_OPS = {"run_and_save_rng_state": 0, "run_with_rng_state": 1,
            "graphsafe_run_with_rng_state": 0}


class OpCost(NamedTuple):
    """One op on one core. engine: "tensor", "vector" or "comm" (a tuple: hashed per op)."""

    engine: str
    flops: float = 0.0  # tensor-engine FLOPs, or vector element-operations
    bytes: float = 0.0  # HBM bytes read + written
    dtype: str = "bf16"  # tensor-engine rate class: bf16, fp32, fp8
    vector: float = 0.0  # vector work inside a tensor op (attention softmax)
    comm_bytes: float = 0.0  # bytes one rank sends (ring algorithms)
    group: int = 1  # ranks in the collective
    link: str = ""  # the link its member ranks cross (core/topology.py); "": consecutive


@dataclass
class Tally:
    """Op costs aggregated by identical cost (a transformer repeats each op per layer)."""

    ops: dict[OpCost, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, cost: OpCost, times: float = 1.0) -> None:
        self.ops[cost] += times

    def merge(self, other: Tally, times: float = 1.0) -> None:
        for cost, n in other.ops.items():
            self.ops[cost] += n * times

    def extrapolate(self, one: Tally, layers: int) -> Tally:
        """self counted with 2 layers, `one` with 1: the tally of `layers` identical layers."""
        out = Tally()
        out.merge(one)
        keys = set(self.ops) | set(one.ops)
        for k in keys:
            per_layer = self.ops.get(k, 0.0) - one.ops.get(k, 0.0)
            out.ops[k] += per_layer * (layers - 1)
            if abs(out.ops[k]) < 1e-9:
                del out.ops[k]
        return out

    def total(self, what: str, engine: str | None = None) -> float:
        return sum(getattr(c, what) * n for c, n in self.ops.items()
                   if engine is None or c.engine == engine)

    @property
    def tensor_flops(self) -> float:
        return self.total("flops", "tensor")


def dtype_class(dtype: torch.dtype) -> str:
    if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        return "fp32"
    if "float8" in str(dtype):
        return "fp8"
    return "bf16"


def _nbytes(t: torch.Tensor) -> float:
    return float(t.nbytes)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of an op's (args, kwargs) or result, in order (ATen nests lists once)."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def _process_group(val: Any) -> Any:
    """The ProcessGroup a collective's argument names (its name, the boxed group, or the
    group itself), else None."""
    try:
        if isinstance(val, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            name: Any = val  # a group name (c10d's GroupName is a str)
            return _resolve_process_group(name)
        if isinstance(val, torch.ScriptObject):  # c10d's ops take the group boxed
            from torch._C._distributed_c10d import ProcessGroup

            return ProcessGroup.unbox(val)
        if hasattr(val, "size") and hasattr(val, "rank") and not isinstance(val, torch.Tensor):
            return val
    except Exception:  # noqa: BLE001 - not a process group
        pass
    return None


def _group(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, str]:
    """(ranks in a collective's group, the link its member ranks cross: core/topology.py;
    "" where the members are unknown, priced as consecutive ranks)."""
    size = None
    for i, a in enumerate(func._schema.arguments):
        val = args[i] if i < len(args) else kwargs.get(a.name)
        if a.name == "group_size" and isinstance(val, int):
            size = val
        elif val is not None and (pg := _process_group(val)) is not None:
            try:
                import torch.distributed as dist

                from neuronlocal.core import topology

                ranks = dist.get_process_group_ranks(pg)
                return len(ranks), topology.of_ranks(ranks)
            except Exception:  # noqa: BLE001 - a group c10d does not list: its size alone
                with suppress(Exception):
                    return int(pg.size()), ""
    if size is not None:
        return size, ""
    from neuronlocal.core.counters import world_size

    return max(2, world_size(default=2)), ""


def _collective_input_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                            ) -> float:
    """Bytes of a collective's inputs: c10d's in-place ops also take their output buffers
    (`output_tensor` of `_allgather_base_`, the group's whole result), which are not sent."""
    total = 0.0
    for i, a in enumerate(func._schema.arguments):
        if a.name.startswith("output"):
            continue
        val = args[i] if i < len(args) else kwargs.get(a.name)
        total += sum(_nbytes(t) for t in _tensors(val))
    return total


def collective_cost(name: str, nbytes: float, p: int, link: str = "") -> OpCost:
    """Bytes one rank sends for a ring collective of `nbytes` (the input tensor) over p ranks;
    `link`: the link class its ranks cross (core/topology.py), "" if unknown."""
    frac = (p - 1) / p if p > 1 else 0.0
    if "all_reduce" in name or "allreduce" in name:
        sent = 2 * frac * nbytes
    elif "gather" in name:
        sent = (p - 1) * nbytes
    elif "scatter" in name or "all_to_all" in name or "alltoall" in name:
        sent = frac * nbytes
    else:  # broadcast, send, recv, barrier
        sent = nbytes
    return OpCost("comm", comm_bytes=sent, group=p, link=link)


def attention_cost(q: torch.Size, k: torch.Size, v: torch.Size, causal: bool, dtype: str,
                   elem: int, backward: bool = False) -> OpCost:
    """Fused attention over q (..., Sq, D), k (..., Sk, D), v (..., Sk, Dv)."""
    heads = math.prod(q[:-2])
    sq, d, sk, dv = q[-2], q[-1], k[-2], v[-1]
    scores = heads * sq * sk * (0.5 if causal and sq == sk and sq > 1 else 1.0)
    flops = 2.0 * scores * (d + dv)
    kv_heads = math.prod(k[:-2])
    io = (heads * sq * (d + dv) + kv_heads * sk * (d + dv)) * elem  # q, o, k, v
    if backward:  # recompute scores, then dV, dP, dQ, dK: 5 matmuls to the forward's 2
        return OpCost("tensor", 2.5 * flops, 2 * io, dtype, 2 * VECTOR_OPS_PER_SCORE * scores)
    return OpCost("tensor", flops, io, dtype, VECTOR_OPS_PER_SCORE * scores)


_GROUPED_MM = {"_grouped_mm", "_scaled_grouped_mm"}  # MoE experts (flop_counter has no rule)


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    """FLOPs of a grouped matmul: each row meets only its own group's matrix. 2-D x 2-D
    (a weight gradient, groups along the contracted rows): 2 * K * S * N; otherwise each
    output element contracts a's last dimension."""
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
            ins: list[torch.Tensor] | None = None) -> OpCost | None:
    """The cost of one ATen op call, or None for views, allocations and waits. `ins`: the
    tensors of args and kwargs, when the caller has them already."""
    packet = func.overloadpacket
    if packet in _FREE or func.is_view:
        return None
    name = packet.__name__
    ins = _tensors((args, kwargs)) if ins is None else ins
    outs = _tensors(out)
    if func.namespace in ("_c10d_functional", "c10d", "c10d_functional", "_dtensor"):
        if name in _WAIT or not ins:
            return None
        size, link = _group(func, args, kwargs)
        return collective_cost(name, _collective_input_bytes(func, args, kwargs), size, link)
    moved = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
    if name in _SDPA_OPS and len(ins) >= 3:
        q, k, v = ins[:3]
        causal = bool(kwargs.get("is_causal", args[4] if len(args) > 4 and
                                 isinstance(args[4], bool) else False))
        return attention_cost(q.shape, k.shape, v.shape, causal, dtype_class(q.dtype),
                              q.element_size())
    if name in _GROUPED_MM and len(ins) >= 2 and outs:
        return OpCost("tensor", _grouped_mm_flops(ins[0], ins[1], outs[0]), moved,
                      dtype_class(ins[0].dtype))
    if packet in flop_registry:
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        dtype = dtype_class(ins[0].dtype) if ins else "bf16"
        return OpCost("tensor", flops, moved, dtype)
    if name.startswith("empty"):
        return None
    if name in _GATHERS:
        moved = 2 * sum(_nbytes(t) for t in outs) + sum(
            _nbytes(t) for t in ins if not t.is_floating_point())
        return OpCost("vector", float(sum(t.numel() for t in outs)), moved)
    if name in _SCATTERS and len(ins) > 1:
        moved = 2 * sum(_nbytes(t) for t in ins[1:])
        return OpCost("vector", float(sum(t.numel() for t in ins[1:])), moved)
    elements = max([t.numel() for t in ins + outs] or [0])
    if elements == 0:
        return None
    return OpCost("vector", float(elements), moved)


# torch's and neuronlocal's code (its C++ warnings skip the same frames): torch's wrappers
# (torch._compile's disable-Dynamo `inner` around nn.init) are not where the program asked.
_SKIP_FRAMES = (os.path.join(os.path.dirname(torch.__file__), ""),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ""))


_64BIT = (torch.float64, torch.int64, torch.complex128)


_fallbacks: frozenset[str] | None = None


def _may_warn(func: Any, ins: list[torch.Tensor]) -> bool:
    """Whether neuronlocal's core may warn about this op: a CPU fallback or 64-bit data."""
    global _fallbacks
    if _fallbacks is None:
        from neuronlocal.eager import ops

        _fallbacks = frozenset(name.split(".")[0] for name, (flags, _) in ops.decisions().items()
                               if flags & ops.HOST and not flags & ops.QUIET)
    return (any(t.dtype in _64BIT for t in ins)
            or f"{func.namespace}::{func.overloadpacket.__name__}" in _fallbacks)


def _call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """func(*args), with any warning it raises attributed to the program's line that called
    the op (as without this mode on the stack), not to this module."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = func(*args, **kwargs)
    if caught:
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIP_FRAMES):
            frame = frame.f_back
        registry = frame.f_globals.setdefault("__warningregistry__", {})
        for w in caught:
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename,
                                   frame.f_lineno, frame.f_globals.get("__name__"), registry)
    return out


class _FlashAttention(torch.autograd.Function):
    """Attention as one fused op on fake or meta tensors: cost recorded, no S x S tensor."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        _record(attention_cost(q.shape, k.shape, v.shape, causal, dtype_class(q.dtype),
                               q.element_size()))
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v = ctx.saved_tensors
        _record(attention_cost(q.shape, k.shape, v.shape, ctx.causal, dtype_class(q.dtype),
                               q.element_size(), backward=True))
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None


_active: list[Counter] = []


def _record(cost: OpCost) -> None:
    if _active:
        _active[-1].add(cost)


class _AttentionMode(TorchFunctionMode):
    """Replaces F.scaled_dot_product_attention on fake or meta tensors with the fused op, so
    it is costed as Trainium runs it and no S x S tensor is ever made."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        causal = bool(kwargs.get("is_causal", args[4] if len(args) > 4 else False))
        return _FlashAttention.apply(q, k, v, causal)  # grouped K/V keep their head count


def batch_sharers(indices: torch.Tensor) -> tuple[int, int]:
    """(tokens this rank looks up, ranks that look up the same ones) of an embedding's
    indices. A DTensor's are replicated over some dims of its device mesh (tensor
    parallelism's row-wise embedding: every rank of a TP group feeds the same batch); a
    plain tensor is this rank's own batch."""
    mesh, placements = getattr(indices, "device_mesh", None), getattr(indices, "placements", ())
    if mesh is None:
        return int(indices.numel()), 1
    local = indices.to_local()  # type: ignore[attr-defined]
    shared = math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())
    return int(local.numel()), int(shared)


class Counter(TorchDispatchMode):
    """Adds the cost of every ATen op it sees to `tally` (and to `per_key[key]`, if set).

    `replace_attention` (fake/meta tensors only): attention becomes the fused op.
    `only_device`: count only ops touching a tensor of this device type (eager capture on
    neuron ignores the CPU reference work and the host side of compiled graphs); their
    warnings keep the program's line as their location.
    """

    supports_higher_order_operators = True  # handled in `_higher_order`

    def __init__(self, replace_attention: bool = True, only_device: str | None = None) -> None:
        super().__init__()
        self.tally = Tally()
        self.per_key: dict[str, Tally] = {}
        self.key: str | None = None
        self.only_device = only_device
        self._paused = 0
        self._bodies: list[Tally] = []  # tallies of higher-order bodies running now
        self.uncounted: set[str] = set()  # higher-order operators run without their cost
        self.error: str | None = None  # the first failure of the counting itself
        # A capture's overlap.Timeline: every cost also goes there, in issue order, each
        # collective with how it runs relative to compute (None: not recorded).
        self.timeline: Any = None
        # Tokens fed since the last reset: the largest index tensor an embedding looked up
        # (a position embedding looks up fewer), the batch x sequence of the step; and the
        # ranks that looked up those same tokens (`batch_sharers`).
        self.tokens = 0
        self.token_sharers = 1
        # On real tensors (eager capture) attention runs as the program runs it, op by op.
        self._attention = _AttentionMode() if replace_attention else None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # torch.compile keeps compiling; compiled graphs are costed on their own

    def add(self, cost: OpCost, times: float = 1.0, alongside: str | None = None) -> None:
        """`alongside`: for a collective that runs beside compute, its kind (overlap.py)."""
        if self._bodies:
            self._bodies[-1].add(cost, times)
            return
        self.tally.add(cost, times)
        if self.timeline is not None:
            self.timeline.add(cost, times, alongside)
        if self.key is not None:
            self.per_key.setdefault(self.key, Tally()).add(cost, times)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> Counter:
        _active.append(self)
        if self._attention is not None:
            self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._attention is not None:
            self._attention.__exit__(*exc)
        _active.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        try:  # the observer's own decisions: a failure here only stops the counting
            decompose = bool(self._bodies) and _composite(func)
            ins = _tensors((args, kwargs)) if self.only_device is not None else None
            mine = ins is None or any(t.device.type == self.only_device for t in ins)
            warn = ins is not None and mine and _may_warn(func, ins)
        except Exception as e:  # noqa: BLE001 - counting must never break the program
            self.failed(e)
            decompose = mine = warn = False
        if decompose:
            # Below autograd (inside a higher-order body) a composite op such as matmul
            # arrives whole: its decomposition runs anyway, so run it here, costed op by op.
            with self._resumed():
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = _call(func, args, kwargs) if warn else func(*args, **kwargs)
        if mine and not self._paused:
            self._count(func, args, kwargs, out, ins)
        return out

    def failed(self, e: BaseException) -> None:
        """Records the first failure of the counting itself ("not estimated: why")."""
        if self.error is None:
            self.error = f"{type(e).__name__}: {e}"[:300]

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
               ins: list[torch.Tensor] | None) -> None:
        try:
            if func.overloadpacket is torch.ops.aten.embedding and len(args) > 1:
                fed, shared = batch_sharers(args[1])
                if fed > self.tokens:
                    self.tokens, self.token_sharers = fed, shared
            ins = _tensors((args, kwargs)) if ins is None else ins
            if any(hasattr(t, "_local_tensor") for t in ins):
                # A DTensor op reaches this mode whole, with global shapes; DTensor runs its
                # shard's op below the mode, unseen. Each rank does its shard's work: cost it.
                args, kwargs, out = tree_map_only(
                    torch.Tensor, lambda t: getattr(t, "_local_tensor", t), (args, kwargs, out))
                ins = _tensors((args, kwargs))
            cost = op_cost(func, args, kwargs, out, ins)
            if cost is not None:
                self.add(cost, alongside=self.timeline.alongside(func, args, kwargs)
                         if self.timeline is not None and cost.engine == "comm" else None)
        except Exception:  # noqa: BLE001 - an op without a cost rule is left out
            pass

    def _mine(self, args: Any, kwargs: dict[str, Any]) -> bool:
        return self.only_device is None or any(
            t.device.type == self.only_device for t in _tensors((args, kwargs)))

    @contextmanager
    def _resumed(self) -> Iterator[None]:
        """This mode back on the stack (the dispatcher pops it while it handles an op)."""
        TorchDispatchMode.__enter__(self)
        try:
            yield
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)

    def _higher_order(self, func: HigherOrderOperator, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """Runs a higher-order operator as it runs without this mode, costing its bodies."""
        name = func.name()
        try:
            counting = not self._paused and self._mine(args, kwargs)
        except Exception as e:  # noqa: BLE001 - counting must never break the program
            self.failed(e)
            counting = False
        if name in _RNG_OPS:
            at = _RNG_OPS[name]
            out = func(*args, **kwargs)
            if counting:
                inner = out[1] if name == "run_and_save_rng_state" else out
                op_kwargs = {k: v for k, v in kwargs.items() if k != "rng_state"}
                self._count(args[at], tuple(args[at + 1:]), op_kwargs, inner, None)
            return out
        if name.startswith("flex_attention"):
            out = func(*args, **kwargs)
            if counting:
                self._count_flex(name, args)
            return out
        if name not in _BODIES:
            self.uncounted.add(name)
            return func(*args, **kwargs)
        ran: list[Tally] = []
        bodies = set(_BODIES[name])
        wrapped = tuple(self._body(a, ran) if i in bodies and callable(a) else a
                        for i, a in enumerate(args))
        out = func(*wrapped, **kwargs)
        if counting:
            for cost, n in _costliest(ran).ops.items() if name == "cond" else (
                    (c, n) for t in ran for c, n in t.ops.items()):
                self.add(cost, n)
        return out

    def _body(self, fn: Callable[..., Any], ran: list[Tally]) -> Callable[..., Any]:
        """`fn` run with this mode back on, its ops added to a tally of their own."""
        def run(*a: Any, **kw: Any) -> Any:
            tally = Tally()
            self._bodies.append(tally)
            try:
                with self._resumed():
                    return fn(*a, **kw)
            finally:
                self._bodies.pop()
                ran.append(tally)

        if getattr(fn, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _count_flex(self, name: str, args: tuple[Any, ...]) -> None:
        try:
            q, k, v = args[:3]
            self.add(attention_cost(q.shape, k.shape, v.shape, False, dtype_class(q.dtype),
                                    q.element_size(), backward=name.endswith("backward")))
        except Exception:  # noqa: BLE001 - counting must never break the program
            self.uncounted.add(name)


_COMPOSITE: dict[Any, bool] = {}


def _composite(func: Any) -> bool:
    """Whether an op is implemented by decomposition (CompositeImplicitAutograd)."""
    hit = _COMPOSITE.get(func)
    if hit is None:
        try:
            hit = func.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd)
        except RuntimeError:  # ops the dispatcher does not list (prim::device)
            hit = False
        _COMPOSITE[func] = hit
    return hit


def _costliest(tallies: list[Tally]) -> Tally:
    """The tally that costs most tensor FLOPs plus bytes (the branch of a cond to count)."""
    return max(tallies, key=lambda t: (t.tensor_flops, t.total("bytes")), default=Tally())
