"""The code-level metrics API: counters a program (or the c10d backend) can feed and read.

TorchNeuron has `torch_neuronx.metrics` with counters and `report()` (spec 7); this is
that seam here. Collectives are counted by the `neuron` process-group backend calling
`record_collective(op, nbytes)` once per collective; everything else (compiles, fallbacks,
memory) is read from the places that already count it, so nothing is counted twice.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from typing import Any

log = logging.getLogger("neuronlocal.report")

_lock = threading.Lock()
_collectives: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])  # -> [count, bytes]
_counters: dict[str, int] = defaultdict(int)


def _rank() -> int:
    """This process's rank: the initialised process group's, else torchrun's RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def record_collective(op: str, nbytes: int, rank: int | None = None) -> None:
    """Counts one collective (e.g. "all_reduce") moving `nbytes` bytes from this rank."""
    r = _rank() if rank is None else rank
    with _lock:
        entry = _collectives[(r, op)]
        entry[0] += 1
        entry[1] += int(nbytes)
    log.debug("collective %s: %d bytes (rank %d)", op, nbytes, r)


def get_collectives() -> list[dict[str, Any]]:
    """[{rank, op, count, bytes}], sorted by rank then op."""
    with _lock:
        items = sorted(_collectives.items())
    return [{"rank": r, "op": op, "count": c, "bytes": b} for (r, op), (c, b) in items]


def increment(name: str, value: int = 1) -> None:
    """A free-form counter (e.g. "steps"), reported with the built-in ones."""
    with _lock:
        _counters[name] += value


def counters() -> dict[str, int]:
    """Every counter of this process: compiles, cache hits, fallbacks, collectives, user ones."""
    from neuronlocal.compile import metrics as compile_metrics
    from neuronlocal.eager import tracking

    m = compile_metrics.get_dynamo_metrics()
    out = {
        "graphs": m["num_graphs"],
        "compiles": m["num_compiles"],
        "cache_hits": m["num_cache_hits"],
        "dynamo_recompiles": len(m["recompiles"]),
        "graph_breaks": sum(b["count"] for b in m["graph_breaks"]),
        "eager_ops": sum(tracking.get_executed_ops().values()),
        "fallback_ops": sum(tracking.get_fallback_ops().values()),
        "downcast_ops": sum(tracking.get_downcast_ops().values()),
    }
    for c in get_collectives():
        out["collectives"] = out.get("collectives", 0) + c["count"]
        out["collective_bytes"] = out.get("collective_bytes", 0) + c["bytes"]
    with _lock:
        out.update(_counters)
    return out


def report() -> str:
    """A plain-text metrics report of this process so far (TorchNeuron's `metrics.report()`)."""
    from neuronlocal.report import collect, render

    return render.text(collect.snapshot())


def reset() -> None:
    """Clears the counters kept here (collectives and user counters)."""
    with _lock:
        _collectives.clear()
        _counters.clear()
