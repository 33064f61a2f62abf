"""Counters a program (or the c10d backend) feeds: collectives per rank and free-form counts.

TorchNeuron's `torch_neuronx.metrics` keeps counters like these. Collectives are counted by
the `neuron` process-group backend calling `record_collective(op, nbytes)` once per
collective. Everything else (compiles, fallbacks, memory) is read from the places that
already count it, by `neuronlocal.report`, so nothing is counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections import defaultdict
from typing import Any

log = logging.getLogger("neuronlocal.report")

_lock = threading.Lock()
_collectives: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])  # -> [count, bytes]
# (rank, op, group size, link class of the group's ranks) -> [count, bytes]
_collective_groups: dict[tuple[int, str, int, str], list[int]] = defaultdict(lambda: [0, 0])
_counters: dict[str, int] = defaultdict(int)
_swaps: dict[tuple[str, str], int] = defaultdict(int)  # (model, layer class) -> modules


def current_rank() -> int:
    """This process's rank: the initialised process group's, else torchrun's RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):
        pass
    return launcher_count("RANK", 0, minimum=0)


def world_size(default: int = 1) -> int:
    """torchrun's WORLD_SIZE, or `default` when unset or unusable (see `launcher_count`)."""
    return launcher_count("WORLD_SIZE", default, minimum=1)


_said: set[str] = set()


def launcher_count(name: str, default: int, minimum: int) -> int:
    """A whole number a launcher sets (RANK, WORLD_SIZE): `default` when unset; a value that
    is not a whole number >= `minimum` warns once, naming it, and counts as `default`, so a
    run still gets its report."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    with contextlib.suppress(ValueError):
        if (value := int(raw)) >= minimum:
            return value
    if name not in _said:
        _said.add(name)
        warnings.warn(f"{name}={raw[:40]!r} is not a whole number >= {minimum}; neuronlocal "
                      f"counts it as {default}. Set it to a number, or unset it (torchrun "
                      "sets it for each rank).", stacklevel=2)
    return default


def record_collective(op: str, nbytes: int, rank: int | None = None,
                      group_size: int | None = None, link: str = "") -> None:
    """Counts one collective (e.g. "all_reduce") moving `nbytes` bytes from this rank, in a
    group of `group_size` ranks (when known) whose members cross `link` (core/topology.py's
    class of their ranks; "" if unknown)."""
    r = current_rank() if rank is None else rank
    with _lock:
        entry = _collectives[(r, op)]
        entry[0] += 1
        entry[1] += int(nbytes)
        if group_size is not None:
            g = _collective_groups[(r, op, int(group_size), link)]
            g[0] += 1
            g[1] += int(nbytes)
    log.debug("collective %s: %d bytes (rank %d)", op, nbytes, r)


def get_collectives() -> list[dict[str, Any]]:
    """[{rank, op, count, bytes}], sorted by rank then op."""
    with _lock:
        items = sorted(_collectives.items())
    return [{"rank": r, "op": op, "count": c, "bytes": b} for (r, op), (c, b) in items]


def get_collective_groups() -> list[dict[str, Any]]:
    """[{rank, op, group_size, link, count, bytes}]: collectives by their group's size and
    the link its member ranks cross."""
    with _lock:
        items = sorted(_collective_groups.items())
    return [{"rank": r, "op": op, "group_size": g, "link": link, "count": c, "bytes": b}
            for (r, op, g, link), (c, b) in items]


def increment(name: str, value: int = 1) -> None:
    """A free-form counter (e.g. "steps"), reported with the built-in ones."""
    with _lock:
        _counters[name] += value


def user_counters() -> dict[str, int]:
    """The free-form counters, by name."""
    with _lock:
        return dict(_counters)


def record_kernel_swap(model: str, layers: dict[str, int]) -> None:
    """`kernels.kernelize` replaced the forward of `layers` ({layer class: modules}) in a
    `model` with a kernel layer's."""
    with _lock:
        for layer, n in layers.items():
            _swaps[(model, layer)] += n


def get_kernel_swaps() -> list[dict[str, Any]]:
    """[{model, layer, modules}] of every kernelize on neuron, sorted."""
    with _lock:
        items = sorted(_swaps.items())
    return [{"model": m, "layer": layer, "modules": n} for (m, layer), n in items]


def reset() -> None:
    """Clears the counters kept here (collectives, user counters, kernel swaps)."""
    with _lock:
        _collectives.clear()
        _collective_groups.clear()
        _counters.clear()
        _swaps.clear()
