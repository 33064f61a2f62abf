"""The batch-norm helper ops nn.SyncBatchNorm calls, for neuron.

ATen has only CUDA kernels for `batch_norm_stats`, `batch_norm_elemt`,
`batch_norm_gather_stats_with_counts`, `batch_norm_backward_reduce` and
`batch_norm_backward_elemt`, so the CPU fallback has nothing to run; TorchNeuron runs them on
the device. These compute the same quantities as CUDA's kernels with ATen CPU math on the
tensors' host bytes (CPU aliases), in float32 for 16-bit inputs as CUDA accumulates.
"""

from __future__ import annotations

from typing import Any

import torch

from neuronlocal import _C

Tensor = torch.Tensor


def _host(t: Tensor) -> Tensor:
    return _C._cpu_alias(t) if t.device.type == "neuron" else t


def _out(like: Tensor, *ts: Tensor) -> Any:
    return tuple(_C._bridge_out(list(ts), like.device.index))


def _acc(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _channel(t: Tensor, ndim: int) -> Tensor:
    """A per-channel vector shaped to broadcast over (N, C, *spatial)."""
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def batch_norm_stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = _acc(_host(input))
    var, mean = torch.var_mean(x, dim=_dims(x), correction=0)
    return _out(input, mean, torch.rsqrt(var + eps))


def batch_norm_elemt(input: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                     invstd: Tensor, eps: float) -> Tensor:
    x = _host(input)
    n = x.dim()
    y = (_acc(x) - _channel(_host(mean), n)) * _channel(_host(invstd), n)
    if weight is not None:
        y = y * _channel(_host(weight), n)
    if bias is not None:
        y = y + _channel(_host(bias), n)
    return _out(input, y.to(input.dtype))[0]


def batch_norm_gather_stats_with_counts(
        input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Tensor | None,
        running_var: Tensor | None, momentum: float, eps: float, counts: Tensor
) -> tuple[Tensor, Tensor]:
    """Combines the per-rank (mean, invstd, count) rows into global statistics and updates the
    running statistics in place (unbiased variance), as CUDA's kernel does."""
    m, s, c = (_acc(_host(t)) for t in (mean, invstd, counts))
    c = c.to(m.dtype).reshape(-1, 1)
    total = c.sum()
    g_mean = (m * c).sum(0) / total
    var = (1.0 / (s * s) - eps + (m - g_mean) ** 2) * c
    g_var = var.sum(0) / total
    for run, new in ((running_mean, g_mean), (running_var, g_var * total / (total - 1))):
        if run is not None:
            r = _host(run)
            r.mul_(1 - momentum).add_(new.to(r.dtype), alpha=momentum)
    return _out(input, g_mean, torch.rsqrt(g_var + eps))


def batch_norm_backward_reduce(
        grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None,
        input_g: bool, weight_g: bool, bias_g: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g, x = _acc(_host(grad_out)), _acc(_host(input))
    n = x.dim()
    sum_dy = g.sum(_dims(g))
    sum_dy_xmu = (g * (x - _channel(_host(mean), n))).sum(_dims(g))
    dtype = weight.dtype if weight is not None else mean.dtype
    grad_weight = (sum_dy_xmu * _host(invstd)).to(dtype)
    return _out(input, sum_dy, sum_dy_xmu, grad_weight, sum_dy.to(dtype))


def batch_norm_backward_elemt(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
                              weight: Tensor | None, sum_dy: Tensor, sum_dy_xmu: Tensor,
                              count: Tensor) -> Tensor:
    g, x = _acc(_host(grad_out)), _acc(_host(input))
    n = x.dim()
    total = _host(count).sum().to(g.dtype)
    s = _channel(_host(invstd), n)
    mean_dy = _channel(_host(sum_dy), n) / total
    mean_dy_xmu = _channel(_host(sum_dy_xmu), n) / total
    gi = (g - mean_dy - (x - _channel(_host(mean), n)) * s * s * mean_dy_xmu) * s
    if weight is not None:
        gi = gi * _channel(_host(weight), n)
    return _out(input, gi.to(input.dtype))[0]


KERNELS = {f.__name__: f for f in (batch_norm_stats, batch_norm_elemt,
                                   batch_norm_gather_stats_with_counts,
                                   batch_norm_backward_reduce, batch_norm_backward_elemt)}


def _recorded(name: str, kernel: Any) -> Any:
    """The kernel, recording the op as executed: TorchNeuron runs these on the device and its
    tracking lists them."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _C._record_executed(f"aten::{name}", "")
        return kernel(*args, **kwargs)

    return run


def register(lib: torch.library.Library) -> None:
    for name, kernel in KERNELS.items():
        lib.impl(name, _recorded(name, kernel), "PrivateUse1")
