"""FlexAttention on neuron: compiled only, as on TorchNeuron.

PyTorch's `flex_attention` checks the device of its inputs against a list (CUDA, CPU, XPU,
HPU, MPS) before anything runs, in eager mode and while Dynamo traces it. TorchNeuron runs
FlexAttention only under `torch.compile`, where its backend decomposes the operator into
plain ops (its gpt-oss example lets neuron tensors past that check). Here:

- neuron tensors pass the check while Dynamo traces; eager `flex_attention` on neuron keeps
  PyTorch's error ("FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices"),
  which is TorchNeuron's behaviour too;
- with the default compiler the `flex_attention` and `flex_attention_backward` operators of
  AOTAutograd's graphs run PyTorch's dense ATen implementation on the neuron tensors one
  block of query rows at a time (scores, score_mod and mask_mod applied to the block's
  scores, softmax, matmul), through the eager path: op placement, CPU-fallback tracking,
  HBM; memory grows with the block, not with seq^2 per head;
- under `torch.autocast("neuron")` the operator casts query, key and value to the autocast
  dtype, as its CPU and CUDA autocast kernels do (PyTorch has none for PrivateUse1);
- Inductor on CPU lowers FlexAttention for inference only, without the log-sum-exp, so the
  Inductor compiler gets a copy of the graph in which the operator is replaced by
  `dense_flex_attention` (the same computation in ATen ops), whose backward AOTAutograd
  derives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import fx

from neuronlocal import patching


def _allow_compiled(mod: ModuleType) -> None:
    """torch.nn.attention.flex_attention: neuron inputs pass the device check under Dynamo."""
    original: Callable[..., None] = mod._validate_device
    if getattr(original, "_neuronlocal", False):
        return

    def _validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "neuron" and torch.compiler.is_compiling():
            return
        original(query, key, value)

    _validate_device._neuronlocal = True  # type: ignore[attr-defined]
    mod._validate_device = _validate_device  # type: ignore[attr-defined]


def _autocast_kernel(hop_mod: ModuleType) -> None:
    """The FlexAttention operator under autocast on neuron: PyTorch gives it autocast kernels
    for CPU and CUDA only, so a compiled FlexAttention inside `torch.autocast("neuron")`
    found no kernel. As on those devices: query, key and value cast to the autocast dtype,
    then the operator with autocast off."""
    from torch._C import DispatchKey
    from torch.amp.autocast_mode import _cast

    hop = hop_mod.flex_attention
    if getattr(hop, "_neuronlocal", False):
        return
    neuron_key = DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]

    def autocast(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 *rest: Any) -> Any:
        dtype = torch.get_autocast_dtype("neuron")
        query, key, value = (_cast(t, "neuron", dtype) for t in (query, key, value))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(neuron_key)):
            return hop(query, key, value, *rest)

    hop.py_impl(neuron_key)(autocast)
    hop._dispatch_cache.clear()
    hop._neuronlocal = True


def _repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with their heads repeated for grouped-query attention, batch expanded."""
    group = query.size(1) // key.size(1)
    return (key.repeat_interleave(group, dim=1).expand(query.size(0), -1, -1, -1),
            value.repeat_interleave(group, dim=1).expand(query.size(0), -1, -1, -1))


def dense_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         score_mod: Callable[..., Any], block_mask: tuple[Any, ...],
                         scale: float, kernel_options: dict[str, Any],
                         score_mod_other_buffers: tuple[Any, ...] = (),
                         mask_mod_other_buffers: tuple[Any, ...] = (),
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `flex_attention` operator in ATen ops: (output, log-sum-exp, row max), the last two
    in base 2 as the operator returns them. Rows that mask every key give zeros and -inf,
    with finite gradients (autograd derives the backward)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    key, value = _repeat_kv(query, key, value)
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale
    b, h, m, n = (torch.arange(s, device=scores.device) for s in scores.shape)
    score_fn = _vmap_for_bhqkv(score_mod, prefix=(0,),
                               suffix=(None,) * len(score_mod_other_buffers))
    mask_fn = _vmap_for_bhqkv(block_mask[-1], prefix=(),
                              suffix=(None,) * len(mask_mod_other_buffers))
    with TransformGetItemToIndex():
        keep = mask_fn(b, h, m, n, *mask_mod_other_buffers)
        scores = torch.where(keep, score_fn(scores, b, h, m, n, *score_mod_other_buffers),
                             torch.tensor(-math.inf, dtype=work, device=scores.device))
    empty = (scores == -math.inf).all(dim=-1)
    safe = scores.masked_fill(empty.unsqueeze(-1), 0.0)  # no -inf - -inf in empty rows
    lse = safe.logsumexp(dim=-1).masked_fill(empty, -math.inf)
    probs = safe.softmax(dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = probs.to(query.dtype) @ value.to(query.dtype)
    return out, lse / math.log(2), scores.amax(dim=-1) / math.log(2)


# fp32 bytes of one block's score matrix: a block of query rows is attended at a time, so
# memory grows with rows x keys of a block (a few such tensors live at once), not seq^2.
BLOCK_SCORE_BYTES = 32 * 2**20


def block_rows(query: torch.Tensor, key: torch.Tensor, q_block: int = 128) -> int:
    """Query rows per block: the most whose fp32 scores fit BLOCK_SCORE_BYTES (whole
    multiples of the block mask's query block when more than one fits), at least one."""
    per_row = max(1, query.size(0) * query.size(1) * key.size(-2) * 4)
    rows = max(1, BLOCK_SCORE_BYTES // per_row)
    return min(query.size(-2), rows if rows < q_block else rows // q_block * q_block)


def _shift_score(fn: Callable[..., Any], q0: int, kv0: int) -> Callable[..., Any]:
    """score_mod (score, b, h, q_idx, kv_idx, *buffers) of a block at row q0, key kv0."""
    return lambda score, b, h, q, kv, *rest: fn(score, b, h, q + q0, kv + kv0, *rest)


def _shift_mask(fn: Callable[..., Any], q0: int, kv0: int) -> Callable[..., Any]:
    """mask_mod (b, h, q_idx, kv_idx, *buffers) of a block at row q0, key kv0."""
    return lambda b, h, q, kv, *rest: fn(b, h, q + q0, kv + kv0, *rest)


@dataclass(frozen=True)
class Block:
    """One block of query rows: rows start..end attend keys k0..k1; `masked` lists the key
    ranges (absolute, within k0..k1) where mask_mod must be applied: the others are key
    blocks the block mask lists as full (every entry kept) for all of the block's rows."""

    start: int
    end: int
    k0: int
    k1: int
    masked: tuple[tuple[int, int], ...]


def _listed(num: Any, idx: Any, rows: slice) -> torch.Tensor | None:
    """The key blocks the mask lists for these query blocks, as a (..., rows, blocks) bool
    table, or None when that part of the mask is absent."""
    if not isinstance(num, torch.Tensor) or not isinstance(idx, torch.Tensor):
        return None
    n, i = num[..., rows].cpu(), idx[..., rows, :].cpu().long()
    keep = torch.arange(i.size(-1)) < n.unsqueeze(-1)
    table = torch.zeros(*i.shape[:-1], max(i.size(-1), 1) + 1, dtype=torch.bool)
    table.scatter_(-1, torch.where(keep, i, table.size(-1) - 1), True)
    return table[..., :-1]


def _span(block_mask: tuple[Any, ...], start: int, end: int, seq_kv: int) -> Block:
    """The keys rows start..end can attend, from the block mask's sparse indices: the first
    to the last key block any of them lists (a causal mask halves the work), and where the
    mask must be applied. All keys, masked, when the mask's values are not known (a dry run
    computes none) or its layout is not."""
    from neuronlocal.core import dryrun

    whole = Block(start, end, 0, seq_kv, ((0, seq_kv),))
    try:
        q_block, kv_block = int(block_mask[-3]), int(block_mask[-2])
        if dryrun.enabled():
            return whole
        rows = slice(start // q_block, (end - 1) // q_block + 1)
        some = _listed(block_mask[2], block_mask[3], rows)
        full = _listed(block_mask[4], block_mask[5], rows)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return whole
    if some is None:
        return whole
    seen = some if full is None else some | full
    used = seen.flatten(0, -2).any(dim=0).nonzero().flatten().tolist()
    if not used:  # every row masked: one masked block gives -inf rows
        return Block(start, end, 0, min(seq_kv, kv_block), ((0, min(seq_kv, kv_block)),))
    k0, k1 = used[0] * kv_block, min(seq_kv, (used[-1] + 1) * kv_block)
    always = (full.flatten(0, -2).all(dim=0) if full is not None
              else torch.zeros(seen.size(-1), dtype=torch.bool))
    masked: list[tuple[int, int]] = []
    for j in range(used[0], used[-1] + 1):
        c0, c1 = j * kv_block, min(seq_kv, (j + 1) * kv_block)
        if bool(always[j]) and c1 - c0 == kv_block:
            continue
        if masked and masked[-1][1] == c0:
            masked[-1] = (masked[-1][0], c1)
        else:
            masked.append((c0, c1))
    return Block(start, end, k0, k1, tuple(masked))


def _blocks(query: torch.Tensor, key: torch.Tensor, block_mask: tuple[Any, ...]
            ) -> list[Block]:
    """The blocks of query rows, with the keys each attends (see Block)."""
    q_block = block_mask[-3] if isinstance(block_mask[-3], int) else 128
    rows = block_rows(query, key, q_block)
    seq_q, seq_kv = query.size(-2), key.size(-2)
    return [_span(block_mask, s, min(s + rows, seq_q), seq_kv) for s in range(0, seq_q, rows)]


def _shifted(block_mask: tuple[Any, ...], q0: int, kv0: int) -> tuple[Any, ...]:
    return (*block_mask[:-1], _shift_mask(block_mask[-1], q0, kv0))


def _block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable[..., Any], mask_mod: Callable[..., Any], scale: float,
                   score_buffers: tuple[Any, ...], mask_buffers: tuple[Any, ...],
                   block: Block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block: (output, natural log-sum-exp, row max) as PyTorch's `math_attention`
    computes them (fp32 scores, score_mod and mask_mod vmapped over the block's indices,
    fully masked rows give zeros and -inf), in fewer passes over the block's scores: the
    scale goes on the queries, mask_mod only where the block mask says it can hide keys."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    key, value = _repeat_kv(query, key, value)
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = query.to(work) @ key.to(work).transpose(-2, -1)
    scores.mul_(scale)
    b, h, m = (torch.arange(x, device=scores.device) for x in scores.shape[:3])
    with TransformGetItemToIndex():
        if score_mod is not _identity:
            n = torch.arange(scores.size(-1), device=scores.device)
            scores = _vmap_for_bhqkv(_shift_score(score_mod, block.start, block.k0),
                                     prefix=(0,), suffix=(None,) * len(score_buffers))(
                scores, b, h, m, n, *score_buffers)
        for c0, c1 in block.masked:
            n = torch.arange(c1 - c0, device=scores.device)
            keep = _vmap_for_bhqkv(_shift_mask(mask_mod, block.start, c0), prefix=(),
                                   suffix=(None,) * len(mask_buffers))(b, h, m, n,
                                                                       *mask_buffers)
            cols = scores[..., c0 - block.k0:c1 - block.k0]
            cols.masked_fill_((~keep).expand(cols.shape), -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    empty = top == -math.inf
    weights = scores.sub_(top.masked_fill(empty, 0.0)).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    if work == query.dtype:
        out = (weights @ value.to(work)).div_(total.masked_fill(empty, 1.0))
    else:  # as math_attention: probabilities cast to the inputs' dtype, then the matmul
        out = weights.div_(total.masked_fill(empty, 1.0)).to(query.dtype) @ value
    lse = (top + total.log()).masked_fill(empty, -math.inf)
    return out.to(query.dtype), lse.squeeze(-1), top.squeeze(-1)


def _identity(score: torch.Tensor, *_: Any) -> torch.Tensor:
    return score


def _is_identity(fn: Callable[..., Any]) -> bool:
    """Whether score_mod is FlexAttention's default (a graph returning its first input)."""
    graph = getattr(fn, "graph", None)
    if graph is None:
        return False
    nodes = list(graph.nodes)
    placeholders = [x for x in nodes if x.op == "placeholder"]
    outputs = [x for x in nodes if x.op == "output"]
    return (len(nodes) == len(placeholders) + 1 and len(outputs) == 1 and bool(placeholders)
            and outputs[0].args[0] is placeholders[0])


def blockwise_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             score_mod: Callable[..., Any], block_mask: tuple[Any, ...],
                             scale: float, kernel_options: dict[str, Any],
                             score_mod_other_buffers: tuple[Any, ...] = (),
                             mask_mod_other_buffers: tuple[Any, ...] = (),
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `flex_attention` operator on neuron: PyTorch's dense computation, one block of
    query rows at a time against the keys the block mask lets them see (score_mod and
    mask_mod get the true indices), so no seq x seq score matrix per head is ever held and
    masked-out key blocks cost nothing. Rows are independent and the keys left out are
    masked, so the result is the dense one's."""
    from torch._higher_order_ops.flex_attention import _permute_strides

    mod = _identity if _is_identity(score_mod) else score_mod
    parts = [_block_forward(query[:, :, x.start:x.end], key[:, :, x.k0:x.k1],
                            value[:, :, x.k0:x.k1], mod, block_mask[-1], scale,
                            score_mod_other_buffers, mask_mod_other_buffers, x)
             for x in _blocks(query, key, block_mask)]
    out, lse, top = (torch.cat([p[i] for p in parts], dim=2) if len(parts) > 1 else parts[0][i]
                     for i in range(3))
    # The operator's log-sum-exp and row max are in base 2 (its kernels compute in ln2 space).
    return _permute_strides(out, query.stride()), lse / math.log(2), top / math.log(2)


def _add(total: Any, part: Any) -> Any:
    return part if total is None else total if part is None else total + part


def blockwise_flex_attention_backward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
        logsumexp: torch.Tensor, grad_out: torch.Tensor | None,
        grad_logsumexp: torch.Tensor | None, fw_graph: Callable[..., Any],
        joint_graph: Callable[..., Any] | None, block_mask: tuple[Any, ...], scale: float,
        kernel_options: dict[str, Any], score_mod_other_buffers: tuple[Any, ...],
        mask_mod_other_buffers: tuple[Any, ...]) -> tuple[Any, ...]:
    """The `flex_attention_backward` operator on neuron: PyTorch's dense backward per block of
    query rows and its keys (as the forward); the query gradient is the blocks' side by
    side, the key, value and captured-buffer gradients their sums."""
    from torch._higher_order_ops.flex_attention import sdpa_dense_backward

    grads_q = []
    grad_k, grad_v = torch.zeros_like(key), torch.zeros_like(value)
    grad_buffers: list[Any] | None = None
    for x in _blocks(query, key, block_mask):
        s, e, k0, k1 = x.start, x.end, x.k0, x.k1
        gq, gk, gv, gb = sdpa_dense_backward(
            query[:, :, s:e], key[:, :, k0:k1], value[:, :, k0:k1], out[:, :, s:e],
            logsumexp[:, :, s:e], None if grad_out is None else grad_out[:, :, s:e],
            None if grad_logsumexp is None else grad_logsumexp[:, :, s:e],
            _shift_score(fw_graph, s, k0),
            None if joint_graph is None else _shift_score(joint_graph, s, k0),  # type: ignore[arg-type]
            _shifted(block_mask, s, k0), scale, kernel_options, score_mod_other_buffers,
            mask_mod_other_buffers)
        grads_q.append(gq)
        grad_k[:, :, k0:k1] += gk
        grad_v[:, :, k0:k1] += gv
        grad_buffers = list(gb) if grad_buffers is None else \
            [_add(a, b) for a, b in zip(grad_buffers, gb, strict=True)]
    grad_q = torch.cat(grads_q, dim=2) if len(grads_q) > 1 else grads_q[0]
    return grad_q, grad_k, grad_v, tuple(grad_buffers or ())


def _blockwise_kernels(hop_mod: ModuleType) -> None:
    """Neuron's kernels of the two operators: the blockwise forms above (PyTorch's
    CompositeExplicitAutograd kernels would hold the whole score matrix)."""
    from torch._C import DispatchKey

    for op, fn in ((hop_mod.flex_attention, blockwise_flex_attention),
                   (hop_mod.flex_attention_backward, blockwise_flex_attention_backward)):
        if DispatchKey.PrivateUse1 not in op.py_kernels:
            op.py_impl(DispatchKey.PrivateUse1)(fn)


def _operator_kernels(hop_mod: ModuleType) -> None:
    _autocast_kernel(hop_mod)
    _blockwise_kernels(hop_mod)


def decompose(graph: fx.Graph) -> None:
    """Replaces every `flex_attention` operator of `graph` by `dense_flex_attention`."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.flex_attention:
            node.target = dense_flex_attention


def register() -> None:
    """Lets neuron inputs past FlexAttention's device check under Dynamo, and gives the
    operator its autocast kernel, when (or if) the modules are imported."""
    patching.after_import("torch.nn.attention.flex_attention", _allow_compiled)
    patching.after_import("torch._higher_order_ops.flex_attention", _operator_kernels)
