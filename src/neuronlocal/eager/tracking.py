"""Op tracking (TorchNeuron's top-level API): which ops ran, which fell back to CPU.

Counts are kept in C++ per op overload; these return `{op name: count}` dicts, which
also work as sets of names (`"aten::mm" in get_executed_ops()`). Fallbacks are named by
the op TorchNeuron runs on the host (for a structured op like `aten::atan2`, its
`aten::atan2.out`), as TorchNeuron's own tracking names them; placement: `eager.ops`.
"""

from __future__ import annotations

import neuronlocal._C as _C


def get_executed_ops() -> dict[str, int]:
    """Every ATen op run on neuron tensors since the last clear, with call counts."""
    return dict(_C._executed_ops())


def get_fallback_ops() -> dict[str, int]:
    """Ops that TorchNeuron would execute on the host CPU, with call counts."""
    return dict(_C._fallback_ops())


def get_fallback_traffic() -> dict[str, dict[str, int]]:
    """Per host-fallback op: calls, and bytes the fallback copies to the host (every neuron
    input) and back (written inputs and results), in total: its cost on Trainium."""
    calls = _C._fallback_ops()
    return {op: {"calls": calls.get(op, 0), "to_host": to, "from_host": back}
            for op, (to, back) in _C._fallback_bytes().items()}


def get_downcast_ops() -> dict[str, int]:
    """Ops that computed 64-bit inputs in 32 bits (Trainium numerics), with call counts."""
    return dict(_C._downcast_ops())


def clear_op_tracking() -> None:
    _C._clear_op_tracking()
