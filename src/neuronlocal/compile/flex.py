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

    group = query.size(1) // key.size(1)  # grouped-query attention: repeat the kv heads
    key = key.repeat_interleave(group, dim=1).expand(query.size(0), -1, -1, -1)
    value = value.repeat_interleave(group, dim=1).expand(query.size(0), -1, -1, -1)
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


def block_rows(query: torch.Tensor, key: torch.Tensor) -> int:
    """Query rows per block: the most whose fp32 scores fit BLOCK_SCORE_BYTES (whole
    multiples of 64 rows when more than 64 fit), at least one."""
    per_row = max(1, query.size(0) * query.size(1) * key.size(-2) * 4)
    rows = max(1, BLOCK_SCORE_BYTES // per_row)
    return min(query.size(-2), rows if rows < 64 else rows // 64 * 64)


def _shift_score(fn: Callable[..., Any], start: int) -> Callable[..., Any]:
    """score_mod (score, b, h, q_idx, kv_idx, *buffers) of a block starting at row `start`."""
    return lambda score, b, h, q, kv, *rest: fn(score, b, h, q + start, kv, *rest)


def _shift_mask(fn: Callable[..., Any], start: int) -> Callable[..., Any]:
    """mask_mod (b, h, q_idx, kv_idx, *buffers) of a block starting at row `start`."""
    return lambda b, h, q, kv, *rest: fn(b, h, q + start, kv, *rest)


def _blocks(query: torch.Tensor, key: torch.Tensor) -> list[tuple[int, int]]:
    rows = block_rows(query, key)
    return [(s, min(s + rows, query.size(-2))) for s in range(0, query.size(-2), rows)]


def blockwise_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             score_mod: Callable[..., Any], block_mask: tuple[Any, ...],
                             scale: float, kernel_options: dict[str, Any],
                             score_mod_other_buffers: tuple[Any, ...] = (),
                             mask_mod_other_buffers: tuple[Any, ...] = (),
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `flex_attention` operator on neuron: PyTorch's own dense computation, one block of
    query rows at a time (score_mod and mask_mod see the block's true row indices), so no
    seq x seq score matrix per head is ever held. Rows are independent, so the result is the
    dense one's."""
    from torch._higher_order_ops.flex_attention import _permute_strides, math_attention

    parts = [math_attention(query[:, :, s:e], key, value, _shift_score(score_mod, s),
                            (*block_mask[:-1], _shift_mask(block_mask[-1], s)), scale,
                            kernel_options, score_mod_other_buffers, mask_mod_other_buffers)
             for s, e in _blocks(query, key)]
    out = torch.cat([p[0] for p in parts], dim=2) if len(parts) > 1 else parts[0][0]
    lse = torch.cat([p[1] for p in parts], dim=2) if len(parts) > 1 else parts[0][1]
    top = torch.cat([p[2] for p in parts], dim=2) if len(parts) > 1 else parts[0][2]
    return _permute_strides(out, query.stride()), lse, top


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
    query rows; the query gradient is the blocks' side by side, the key, value and captured
    buffer gradients their sums."""
    from torch._higher_order_ops.flex_attention import sdpa_dense_backward

    grads_q, grad_k, grad_v = [], None, None
    grad_buffers: list[Any] | None = None
    for s, e in _blocks(query, key):
        gq, gk, gv, gb = sdpa_dense_backward(
            query[:, :, s:e], key, value, out[:, :, s:e], logsumexp[:, :, s:e],
            None if grad_out is None else grad_out[:, :, s:e],
            None if grad_logsumexp is None else grad_logsumexp[:, :, s:e],
            _shift_score(fw_graph, s),
            None if joint_graph is None else _shift_score(joint_graph, s),
            (*block_mask[:-1], _shift_mask(block_mask[-1], s)), scale, kernel_options,
            score_mod_other_buffers, mask_mod_other_buffers)
        grads_q.append(gq)
        grad_k, grad_v = _add(grad_k, gk), _add(grad_v, gv)
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
