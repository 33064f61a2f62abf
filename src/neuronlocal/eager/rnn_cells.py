"""The fused RNN cells ATen requires on every device but CPU, computed from device ops.

ATen's LSTM and GRU (nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell) call
`_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` for CUDA, XPU and PrivateUse1 inputs, and
their backward passes `_thnn_fused_lstm_cell_backward_impl` / `_thnn_fused_gru_cell_backward`.
Torch has kernels for them on CUDA only, and TorchNeuron's public snapshot registers none
(their placement says so), so a neuron backend has to bring them. These kernels compute the
cell from its pointwise pieces on neuron tensors (each piece is a device op), with the same
equations as ATen's CPU cell, in float32 for 16-bit inputs (as CUDA's fused kernels
accumulate); the workspace layout is private to the forward/backward pair.
"""

from __future__ import annotations

from typing import Any

import torch

_lib: torch.library.Library | None = None
Tensor = torch.Tensor


def _wide(*ts: Tensor | None) -> list[Any]:
    """16-bit tensors as float32; the rest (None included) as they are, in order."""
    return [t.float() if t is not None and t.dtype in (torch.bfloat16, torch.float16) else t
            for t in ts]


def _narrow(dtype: torch.dtype, *ts: Tensor) -> tuple[Any, ...]:
    return tuple(t.to(dtype) for t in ts)


def _lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor,
               input_bias: Tensor | None = None,
               hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    dtype = input_gates.dtype
    input_gates, hidden_gates, cx, input_bias, hidden_bias = _wide(
        input_gates, hidden_gates, cx, input_bias, hidden_bias)
    gates = input_gates + hidden_gates
    if input_bias is not None and hidden_bias is not None:
        gates = gates + (input_bias + hidden_bias)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return _narrow(dtype, hy, cy, torch.cat([i, f, g, o], 1))


def _lstm_cell_backward(grad_hy: Tensor | None, grad_cy: Tensor | None, cx: Tensor, cy: Tensor,
                        workspace: Tensor, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dtype = cx.dtype
    grad_hy, grad_cy, cx, cy, workspace = _wide(grad_hy, grad_cy, cx, cy, workspace)
    i, f, g, o = workspace.chunk(4, 1)
    tcy = cy.tanh()
    ghy = grad_hy if grad_hy is not None else torch.zeros_like(cy)
    gcy = ghy * o * (1 - tcy * tcy)
    if grad_cy is not None:
        gcy = gcy + grad_cy
    grad_gates = torch.cat([gcy * g * i * (1 - i), gcy * cx * f * (1 - f),
                            gcy * i * (1 - g * g), ghy * tcy * o * (1 - o)], 1)
    return _narrow(dtype, grad_gates, gcy * f, grad_gates.sum(0))


def _gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor,
              input_bias: Tensor | None = None,
              hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    dtype = input_gates.dtype
    input_gates, hidden_gates, hx, input_bias, hidden_bias = _wide(
        input_gates, hidden_gates, hx, input_bias, hidden_bias)
    if input_bias is not None and hidden_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = (hx - n) * z + n
    return _narrow(dtype, hy, torch.cat([r, z, n, hx, hn], 1))


def _gru_cell_backward(grad_hy: Tensor, workspace: Tensor, has_bias: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dtype = grad_hy.dtype
    grad_hy, workspace = _wide(grad_hy, workspace)
    r, z, n, hx, hn = workspace.chunk(5, 1)
    d_in = grad_hy * (1 - z) * (1 - n * n)
    d_z = grad_hy * (hx - n) * z * (1 - z)
    d_r = d_in * hn * r * (1 - r)
    grad_input = torch.cat([d_r, d_z, d_in], 1)
    grad_hidden = torch.cat([d_r, d_z, d_in * r], 1)
    return _narrow(dtype, grad_input, grad_hidden, grad_hy * z, grad_input.sum(0),
                   grad_hidden.sum(0))


KERNELS = {
    "_thnn_fused_lstm_cell": _lstm_cell,
    "_thnn_fused_lstm_cell_backward_impl": _lstm_cell_backward,
    "_thnn_fused_gru_cell": _gru_cell,
    "_thnn_fused_gru_cell_backward": _gru_cell_backward,
}


def register() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    for name, fn in KERNELS.items():
        _lib.impl(name, fn, "PrivateUse1")
