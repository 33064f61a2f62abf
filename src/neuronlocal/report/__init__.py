"""Run report: what a program would cost on Trainium (compiles, fallbacks, memory, traffic).

collect.py gathers during a run, analysis.py explains recompiles and suggests buckets,
render.py draws the terminal summary, JSON and HTML, runner.py is `neuronlocal run`, and
metrics.py is the API for code (`record_collective`, `counters`, `report`).
"""

from __future__ import annotations

from neuronlocal.report.metrics import (
    counters,
    get_collectives,
    increment,
    record_collective,
    report,
    reset,
)

__all__ = ["counters", "get_collectives", "increment", "record_collective", "report", "reset"]
