"""The `neuron` c10d backend: gloo collectives on zero-copy CPU aliases of neuron tensors.

TorchNeuron registers a process-group backend named `neuron`. The collectives live in C++
(`csrc/c10d.cpp`, a `c10d::Backend` over an inner `ProcessGroupGloo`); this module builds
each group (in a dry run, over a backend without gloo whose collectives complete without
peers, met through an in-process store: `dry_rendezvous`). The group is a stock
`ProcessGroup` (made in C++, named `neuron`) with that backend registered for devices
`neuron` and `cpu`, never a Python subclass: Dynamo traces only the stock type (compiled
DDP, FSDP2 and TP need it), C++ callers (DDP's reducer, functional collectives, compiled
graphs passing CPU aliases) reach the backend through c10d's dispatcher without the GIL,
and the gloo threads never run Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
from torch.distributed import ProcessGroup

from neuronlocal import _C
from neuronlocal.core import dryrun, topology
from neuronlocal.core.config import env_flag
from neuronlocal.core.counters import record_collective

BACKEND = "neuron"


class NeuronCollectiveError(dist.DistBackendError):
    """A collective of the `neuron` backend failed (peer died, timeout, mismatched inputs)."""


def checks_enabled() -> bool:
    """Cross-rank checks of every collective's shapes and dtypes (NEURONLOCAL_DIST_CHECKS=1,
    or PyTorch's own switch for the same check, TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        return True
    return env_flag("NEURONLOCAL_DIST_CHECKS")


def install_hooks() -> None:
    """Hands the C++ backend the report hook and the error class, and gives its works their
    Python type (TorchNeuron's `NeuronWork`, with `get_sequence_number()`), once per process."""
    _C._c10d_set_hooks(record_collective, NeuronCollectiveError)
    _C._c10d_register_work(_C)


def make_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
               ranks: Sequence[int] = ()) -> ProcessGroup:
    """A stock ProcessGroup named `neuron` whose collectives run on the C++ neuron backend;
    `ranks`: its members' global ranks (none: the whole world, 0..size-1), whose link class
    (core/topology.py) each collective is recorded with.

    Its device list is `neuron` alone, as TorchNeuron's; CPU tensors are taken only from
    compiled graphs (their CPU aliases) and are otherwise TorchNeuron's ValueError."""
    # The run report is per process: count under the job's rank, not the subgroup's.
    record_rank = dist.get_rank() if dist.is_initialized() else rank
    link = topology.of_ranks(ranks or range(size))
    if dryrun.enabled():  # the group stands for all its ranks: no peers, no gloo
        backend = _C._c10d_dry_backend(rank, size, record_rank, link)
        return _C._c10d_group(store, rank, size, backend)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    backend = _C._c10d_backend(gloo, rank, size, record_rank, str(timeout), checks_enabled(),
                               link)
    return _C._c10d_group(store, rank, size, backend)


def dry_rendezvous(url: str, timeout: timedelta | None = None,
                   **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """A dry run's rendezvous for env://, tcp:// and file://: no peers to meet, so an
    in-process store, with the rank and world size the URL or torchrun's variables give."""
    query = dict(parse_qsl(urlparse(url).query))
    rank = int(query.get("rank", os.environ.get("RANK", "0")))
    world = int(query.get("world_size", os.environ.get("WORLD_SIZE", "1")))
    yield dist.HashStore(), rank, world


def install_dry_rendezvous() -> None:
    """Every standard init_method of a dry run meets no peers (dry_rendezvous)."""
    import importlib

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    for scheme in ("env", "tcp", "file"):
        handlers[scheme] = dry_rendezvous


def make_creator(bind: Callable[[], None]) -> Callable[..., ProcessGroup]:
    """The function `dist.Backend.register_backend` calls for every new `neuron` group."""

    def create(common: Any, _options: Any = None) -> ProcessGroup:
        bind()  # idempotent: the first group of the job binds the rank to its core
        return make_group(common.store, common.group_rank, common.group_size, common.timeout,
                          list(common.global_ranks_in_group))

    return create
