"""The code-level metrics API: counters a program can feed and read, and a text report.

TorchNeuron has `torch_neuronx.metrics` with counters and `report()`; this is that seam
here. The counters themselves live in `neuronlocal.core.counters`; `counters()` adds the
ones read from compile metrics and op tracking (`collect.counters`).
"""

from __future__ import annotations

from neuronlocal.core.counters import get_collectives, increment, record_collective, reset
from neuronlocal.report import collect, render
from neuronlocal.report.collect import counters

__all__ = ["counters", "get_collectives", "increment", "record_collective", "report", "reset"]


def report() -> str:
    """A plain-text metrics report of this process so far (TorchNeuron's `metrics.report()`)."""
    return render.text(collect.snapshot())
