"""The one byte formatter: `fmt_bytes(3 * 2**20)` -> '3.00 MiB' (binary units, as PyTorch's
memory_summary and TorchNeuron's messages use)."""

from __future__ import annotations

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(n: float, digits: int = 2) -> str:
    """`n` bytes in the largest unit it reaches, with `digits` decimals; whole bytes below 1 KiB."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"
