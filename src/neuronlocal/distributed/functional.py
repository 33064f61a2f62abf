"""Functional collectives (`torch.ops._c10d_functional`) on neuron tensors, in eager mode.

TorchNeuron registers these as PrivateUse1 kernels (spec section 4). PyTorch's own kernels
(CompositeExplicitAutograd) already reach our group for all-reduce, all-to-all, broadcast
and the coalesced ops, because the C++ trampoline forwards those methods to Python. It does
not forward `_allgather_base` / `_reduce_scatter_base`: those go to the c10d op of the
tensor's device, which has no `neuron` backend. So the two ops that use them get neuron
kernels here, calling the group's Python methods (zero copy, async: the Work is registered
for `wait_tensor`). Inside compiled graphs the bridge hands CPU aliases, which take
PyTorch's CPU path to the group's gloo backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch.distributed.distributed_c10d import _resolve_process_group

_lib: torch.library.Library | None = None

REDUCE_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}


def _reduce_op(name: str) -> dist.ReduceOp.RedOpType:
    try:
        return REDUCE_OPS[name.lower()]
    except KeyError:
        raise ValueError(f"neuron backend: reduce op {name!r} is not supported; use one of "
                         f"{sorted(REDUCE_OPS)}.") from None


def _gather_shape(input: torch.Tensor, group_size: int) -> list[int]:
    shape = list(input.shape) or [1]
    shape[0] *= group_size
    return shape


def all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: Any,
                               *, out: torch.Tensor) -> torch.Tensor:
    pg = _resolve_process_group(group_name)
    work = pg._allgather_base(out, input.contiguous(), _c10d.AllgatherOptions())
    torch._C._distributed_c10d._register_work(out, work)
    return out


def all_gather_into_tensor(input: torch.Tensor, group_size: int,
                           group_name: Any) -> torch.Tensor:
    out = input.new_empty(_gather_shape(input, group_size))
    return all_gather_into_tensor_out(input, group_size, group_name, out=out)


def reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str, group_size: int,
                              group_name: Any, *, out: torch.Tensor) -> torch.Tensor:
    pg = _resolve_process_group(group_name)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(reduce_op)
    work = pg._reduce_scatter_base(out, input.contiguous(), opts)
    torch._C._distributed_c10d._register_work(out, work)
    return out


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int,
                          group_name: Any) -> torch.Tensor:
    if input.dim() == 0 or input.shape[0] % group_size:
        raise ValueError(f"neuron backend: reduce_scatter_tensor needs input.shape[0] "
                         f"divisible by the group size {group_size}, got {tuple(input.shape)}.")
    shape = list(input.shape)
    shape[0] //= group_size
    out = input.new_empty(shape)
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)


def register() -> None:
    """Registers the neuron kernels once (idempotent)."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("_c10d_functional", "IMPL")
    for name, fn in (("all_gather_into_tensor", all_gather_into_tensor),
                     ("all_gather_into_tensor_out", all_gather_into_tensor_out),
                     ("reduce_scatter_tensor", reduce_scatter_tensor),
                     ("reduce_scatter_tensor_out", reduce_scatter_tensor_out)):
        _lib.impl(name, fn, "PrivateUse1")
