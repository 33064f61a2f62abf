"""Op support as data: what TorchNeuron runs on the device and what it runs on CPU.

Every ATen op runs on `neuron` here (CPU kernels on host memory). What differs is what
it would cost on Trainium, and that is recorded per op:

- `CPU_FALLBACK_OPS`: ops TorchNeuron executes on the host (spec 2.3 and 2.5). They run,
  warn once, are counted by `torch_neuronx.get_fallback_ops()`, and are errors under
  `NEURONLOCAL_STRICT=1`.
- everything else with an ATen kernel is "native": a device kernel exists on Trainium.
- CompositeImplicitAutograd ops never reach a backend: they are "decomposed".

The CLI (`neuronlocal ops`), docs/op-support.md and the tests all read this module.
"""

from __future__ import annotations

import torch

_LINALG = "linear algebra runs on the host CPU in TorchNeuron (spec 2.3)"
_RANDOM = "random fills are drawn by the host generator in TorchNeuron (spec 2.5)"

CPU_FALLBACK_OPS: dict[str, str] = {
    **{f"aten::{name}": _LINALG for name in (
        "linalg_qr", "_linalg_svd", "_linalg_eigh", "linalg_eig", "linalg_cholesky_ex",
        "cholesky", "linalg_inv_ex", "linalg_lu", "linalg_lu_factor_ex", "lu_unpack",
        "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_slogdet", "_linalg_det",
        "cholesky_inverse", "cholesky_solve", "_cholesky_solve_helper", "triangular_solve",
        "linalg_solve_triangular", "_linalg_solve_ex", "linalg_lu_solve", "geqrf", "ormqr",
        "linalg_householder_product", "_linalg_eigvals", "linalg_eigvals",
    )},
    **{f"aten::{name}": _RANDOM for name in ("normal_", "uniform_", "bernoulli_", "random_")},
}


def status(op: str) -> str:
    """'cpu-fallback', 'decomposed' or 'native' for an op name like 'aten::mm' or 'aten::mm.out'."""
    base = op.split(".", 1)[0]
    if base in CPU_FALLBACK_OPS:
        return "cpu-fallback"
    if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd"):
        return "decomposed"
    return "native"


# Composite (CompositeExplicitAutograd) kernels that reject tensors on devices they do not
# know ("mode only supports CPU, CUDA and XPU device type"): the fallback is registered
# directly, so they run on CPU aliases like every other op.
DEVICE_CHECKING_COMPOSITES: tuple[str, ...] = ("mode.values",)


def structured_ops() -> list[str]:
    """Ops with a CPU kernel whose neuron entry would otherwise run a composite instead.

    - structured kernels (CompositeExplicitAutogradNonFunctional) would decompose into
      `empty` + `out=`: direct, each costs one dispatch instead of two;
    - ops with both a CompositeExplicitAutograd and a CPU kernel (native_layer_norm,
      native_group_norm, addr, _stack, ...) would run the composite, whose numerics differ
      from CPU's fused kernel: direct, neuron computes exactly what CPU does.

    They get the fallback registered directly (unless neuron has its own kernel).
    """
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not has(name, "CPU") or has(name, "PrivateUse1"):
            continue
        if has(name, "CompositeExplicitAutogradNonFunctional") \
                or has(name, "CompositeExplicitAutograd"):
            names.append(name[len("aten::"):])
    names += [n for n in DEVICE_CHECKING_COMPOSITES if not has(f"aten::{n}", "PrivateUse1")]
    return sorted(names)
