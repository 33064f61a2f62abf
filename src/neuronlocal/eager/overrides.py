"""Kernels where Trainium differs from ATen's CPU kernel in what a user can see.

- Device code written for accelerators (CUDA, Neuron) uses dtypes the CPU kernels reject;
  transformers' MoE routing, for one, calls `torch.histc` on int32 expert ids on every
  device but cpu/mps. These run the CPU kernel in a dtype it supports and return the
  device's dtype.
- `contiguous`: TorchNeuron's memory-format contract (`preserve_format` is accepted).
- `linear_backward`: a device kernel TorchNeuron registers and ATen's CPU lacks.
- `rms_norm`: TorchNeuron's kernel computes through `_fused_rms_norm` (16-bit inputs with
  a weight of another dtype in float32), a device kernel whose gradients come from torch's
  formula, `_fused_rms_norm_backward` (a device kernel too; ATen's CPU has neither).
- CompositeImplicitAutograd ops TorchNeuron registers device kernels for (`linear`,
  `isfinite`, ...; `ops.tracked_implicit`): recorded under their own name.
- SyncBatchNorm's helper ops, which ATen has for CUDA only (sync_batch_norm.py).
- Ops that compute in float64 by definition (`float_power`): Trainium computes them in
  float32 (the 64-bit rule), so they warn once per op when that rule is on. They stay
  composites: the kernel warns, then runs torch's own decomposition.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from neuronlocal import _C
from neuronlocal.core import state
from neuronlocal.core.config import env_flag
from neuronlocal.eager import sync_batch_norm

_lib: torch.library.Library | None = None


def histc_host(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
               ) -> torch.Tensor:
    """histc of a CPU tensor with device semantics: integer inputs count in their own dtype
    (as CUDA's kernel does; exact below 2**24). Compiled graphs call it too."""
    if x.is_floating_point():
        return torch.histc(x, bins, min, max)
    return torch.histc(x.double(), bins, min, max).to(x.dtype)


def _histc_device(self: torch.Tensor, bins: int, min: float, max: float) -> torch.Tensor:
    out = histc_host(_C._cpu_alias(self), bins, min, max)
    result = _C._bridge_out([out], self.device.index)[0]
    if _C._dry_run() and _C._dry_has_values(self):  # MoE token counts: real in a dry run
        _C._dry_mark(result, True)
    return result


def _histc(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    _C._record_executed("aten::histc", "")
    return _histc_device(self, bins, min, max)


def _histc_out(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *,
               out: torch.Tensor) -> torch.Tensor:
    """histc into `out`, with device semantics; a dtype mismatch is TorchNeuron's error (its
    MLIR kernel names torch dtypes; with TORCH_NEURONX_MLIR_ATEN_OPS=0, CPU's words)."""
    if self.dtype != out.dtype:
        if env_flag("TORCH_NEURONX_MLIR_ATEN_OPS"):
            raise RuntimeError("torch.histogram: input tensor and hist tensor should have the "
                               f"same dtype, but got input {self.dtype} and hist {out.dtype}")
        torch.histc(_C._cpu_alias(self), bins, min, max, out=_C._cpu_alias(out))
    _C._record_executed("aten::histc", "out")
    result = _histc_device(self, bins, min, max)
    out.resize_(result.shape)
    return out.copy_(result)


def _linear_backward(self: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor,
                     output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """TorchNeuron's device kernel for `linear_backward` (CPU has none: ATen implements it
    for MKLDNN only): the input, weight and bias gradients of `linear`, None where
    output_mask does not ask for them (as MKLDNN's and TorchNeuron's kernels return; the
    weight and bias gradients are computed together, as TorchNeuron's kernel does)."""
    x, g, w = (_C._cpu_alias(t) for t in (self, grad_output, weight))
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    outs: list[torch.Tensor | None] = [g @ w if output_mask[0] else None, None, None]
    if output_mask[1] or output_mask[2]:
        outs[1:] = [g2.t() @ x2, g2.sum(0)]
    _C._record_executed("aten::linear_backward", "")
    moved = iter(_C._bridge_out([t for t in outs if t is not None], self.device.index))
    return tuple(None if t is None else next(moved) for t in outs)


_composite = torch._C.DispatchKey.CompositeImplicitAutograd


def _plain(args: Any) -> bool:
    """Whether an op's tensor arguments are plain tensors (not the fake or functional ones of
    a compile's tracing, which runs no op on the device)."""
    return all(type(a) in (torch.Tensor, torch.nn.Parameter) for a in args
               if isinstance(a, torch.Tensor))


def _tracked_implicit(name: str) -> Any:
    """A kernel for a CompositeImplicitAutograd op TorchNeuron registers: records it as
    executed, then runs its composite, as torch does without this kernel (registered for
    autograd, so gradients are the composite's, and below it, for inference mode)."""
    base, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, base), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _plain(args):
            _C._record_executed(f"aten::{base}", overload)
        return op.decompose(*args, **kwargs)

    return kernel


def _rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    """TorchNeuron's rms_norm: `_fused_rms_norm` of the input, in float32 where a 16-bit
    input has a weight of another dtype, cast back to the input's dtype."""
    if _plain((x, weight)):
        _C._record_executed("aten::rms_norm", "")
    dtype = x.dtype
    if weight is not None and weight.dtype != dtype and dtype in (torch.float16,
                                                                  torch.bfloat16):
        x, weight = x.float(), weight.float()
    return torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)[0].to(dtype)


def _fused_rms_norm(x: torch.Tensor, normalized_shape: list[int],
                    weight: torch.Tensor | None = None, eps: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchNeuron's `_fused_rms_norm` device kernel (torch has only a composite for it):
    tracked, then the composite on the neuron tensors (so a dry run stays data-less);
    registered below autograd, so gradients come from torch's formula,
    `_fused_rms_norm_backward`, as on TorchNeuron."""
    _C._record_executed("aten::_fused_rms_norm", "")
    return torch.ops.aten._fused_rms_norm.default.decompose(x, normalized_shape, weight, eps)


def _fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, normalized_shape: list[int],
                             rstd: torch.Tensor, weight: torch.Tensor | None,
                             output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """TorchNeuron's `_fused_rms_norm_backward` device kernel (ATen's CPU has none): tracked,
    then torch's decomposition on the neuron tensors; None where output_mask leaves a
    gradient out."""
    from torch._decomp import decomposition_table

    _C._record_executed("aten::_fused_rms_norm_backward", "")
    outs = decomposition_table[torch.ops.aten._fused_rms_norm_backward.default](
        grad, x, normalized_shape, rstd, weight, output_mask)
    return tuple(o if m else None for o, m in zip(outs, output_mask, strict=True))


def _contiguous(self: torch.Tensor,
                memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """TorchNeuron's contiguous: `preserve_format` means contiguous; other formats
    (channels_last) are an error with TorchNeuron's build variable
    TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS=1, and run as on CPU with its release
    value (0: TorchNeuron runs them through its CPU fallback). Tracked by name, as
    TorchNeuron's kernel is."""
    if _plain((self,)):
        _C._record_executed("aten::contiguous", "")
    if memory_format == torch.preserve_format:
        memory_format = torch.contiguous_format
    elif memory_format != torch.contiguous_format and env_flag(
            "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"):
        raise RuntimeError("aten::contiguous: Neuron tensors only support contiguous or "
                           "preserve memory format (memory_format=torch.contiguous_format)")
    return torch.ops.aten.contiguous.default._op_dk(_composite, self,
                                                    memory_format=memory_format)


_warned: set[str] = set()


def _float64_kernel(name: str) -> Any:
    pkt, _, overload = name[len("aten::"):].partition(".")
    op = getattr(getattr(torch.ops.aten, pkt), overload or "default")
    composite = _composite

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if state.config.downcast_64bit and name not in _warned:
            _warned.add(name)
            warnings.warn(f"{name} computes in float64 by definition, and Trainium computes "
                          "float64 as float32 (the 64-bit rule), so its results differ from "
                          "CPU's beyond float32 precision. NEURONLOCAL_DOWNCAST_64BIT=0 keeps "
                          "64 bits.", stacklevel=2)
        return op._op_dk(composite, *args, **kwargs)

    return kernel


def register() -> None:
    global _lib
    if _lib is not None:
        return
    from neuronlocal.eager import ops

    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("histc", _histc, "PrivateUse1")
    _lib.impl("histc.out", _histc_out, "PrivateUse1")
    _lib.impl("contiguous", _contiguous, "AutogradPrivateUse1")
    _lib.impl("linear_backward", _linear_backward, "PrivateUse1")
    for key in ("PrivateUse1", "AutogradPrivateUse1"):
        _lib.impl("rms_norm", _rms_norm, key)
    _lib.impl("_fused_rms_norm", _fused_rms_norm, "PrivateUse1")
    _lib.impl("_fused_rms_norm_backward", _fused_rms_norm_backward, "PrivateUse1")
    sync_batch_norm.register(_lib)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in sorted(ops.float64_ops()):
        if has(name, "CompositeImplicitAutograd") and not has(name, "AutogradPrivateUse1"):
            _lib.impl(name[len("aten::"):], _float64_kernel(name), "AutogradPrivateUse1")
    with_cpu, composites = ops.tracked_implicit()
    _C._register_direct(with_cpu)
    for name in composites:
        kernel = _tracked_implicit(name)
        for key in ("PrivateUse1", "AutogradPrivateUse1"):
            _lib.impl(name, kernel, key)
