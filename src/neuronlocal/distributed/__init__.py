"""Distributed: the `neuron` c10d backend, and PyTorch's `fake` group for neuron tensors.

`register()` is called once from `neuronlocal/__init__.py`. It registers backend `neuron`
for device type `neuron`, so both `init_process_group(backend="neuron")` and a bare
`init_process_group()` on a neuron job (PyTorch picks the accelerator's default backend)
get it. Under torchrun the first group binds the rank to its logical core (`bind_rank`).
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from types import ModuleType

import torch.distributed as dist
from torch.distributed import ProcessGroup

from neuronlocal import device as neuron
from neuronlocal import patching
from neuronlocal.distributed.backend import (
    BACKEND,
    NeuronCollectiveError,
    install_dry_rendezvous,
    install_hooks,
    make_creator,
    make_group,
)

__all__ = ["BACKEND", "NeuronCollectiveError", "bind_rank", "make_group", "register"]

_bound = False


def bind_rank() -> None:
    """Binds this rank to `neuron:LOCAL_RANK` and checks the node has enough logical cores.

    TorchNeuron sets NEURON_RT_VISIBLE_CORES=LOCAL_RANK before its runtime starts, so each
    rank sees one core as `neuron:0`. Here the runtime has started by now (the check below
    starts it, if no device use did), so instead the rank keeps every core visible and makes
    `neuron:LOCAL_RANK` its current device (what `"neuron"` means from then on, as with
    CUDA). A rank started with one visible core uses `neuron:0`. NEURON_RT_VISIBLE_CORES is
    set to the rank's core for processes it starts, as TorchNeuron does.
    """
    global _bound
    from neuronlocal.device import check_available

    check_available()  # a bad neuron environment variable: its one-line error, not gloo's
    if _bound:
        return
    _one_core_per_rank()
    raw = os.environ.get("LOCAL_RANK")
    if raw in (None, ""):
        _bound = True  # not launched by torchrun: the script picks its device
        return
    from neuronlocal.core import state
    from neuronlocal.core.config import env_str

    prof = state.profile
    local_rank = int(raw)
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or local_rank + 1)
    where = f"the emulated instance {prof.instance} (LNC={prof.lnc})"
    if local_size > prof.total_cores:
        raise RuntimeError(
            f"neuron backend: torchrun started {local_size} ranks on this node, but {where} "
            f"has {prof.total_cores} logical NeuronCores and TorchNeuron runs one rank per "
            f"core. Use --nproc-per-node <= {prof.total_cores}, or emulate a larger instance "
            "(NEURONLOCAL_INSTANCE=trn2.48xlarge) or LNC=1 (NEURON_LOGICAL_NC_CONFIG=1).")
    if prof.device_count == 1:
        index = 0
    elif local_rank < prof.device_count:
        index = local_rank
    else:
        raise RuntimeError(
            f"neuron backend: LOCAL_RANK={local_rank} but this process sees only "
            f"{prof.device_count} logical cores (NEURON_RT_VISIBLE_CORES="
            f"{env_str('NEURON_RT_VISIBLE_CORES') or 'all'}). Leave "
            "NEURON_RT_VISIBLE_CORES unset, or set it to one core per rank.")
    neuron.set_device(index)
    if env_str("NEURON_RT_VISIBLE_CORES") is None:
        os.environ["NEURON_RT_VISIBLE_CORES"] = str(prof.visible[index])
    _bound = True


def _one_core_per_rank() -> None:
    """TorchNeuron's group init allows one device per process: NEURON_RT_VISIBLE_CORES, when
    set (also after `import torch`, as a spawned worker does), must name a single core."""
    from neuronlocal.core import hardware, state
    from neuronlocal.core.config import env_str

    raw = env_str("NEURON_RT_VISIBLE_CORES")
    if raw and len(cores := hardware.parse_visible(raw, state.profile.total_cores)) > 1:
        raise RuntimeError(
            "neuron backend: Attempted to have more than one device per process in distributed "
            f"setup: NEURON_RT_VISIBLE_CORES={raw} names {len(cores)} cores, and TorchNeuron "
            "runs one rank per core. Set it to one core per rank, or leave it unset (each "
            "rank then takes the core of its LOCAL_RANK).")


def _fake_serves_neuron(_module: ModuleType) -> None:
    """PyTorch's `fake` process group (a group that communicates nothing, for dry runs such as
    torchtitan's `fake_backend` mode) is registered for cpu/cuda/hpu/xpu when its module is
    imported; neuron tensors are served by it too, as hpu's are."""
    devices = dist.Backend.backend_capability.setdefault(dist.Backend.FAKE, [])
    if "neuron" not in devices:
        devices.append("neuron")


def _pg_timeout_reaches_neuron(c10d: ModuleType) -> None:
    """`_set_pg_timeout` sets the timeout of gloo and NCCL groups only; a group with a neuron
    backend (the default group, a device mesh's subgroups, a `neuron:neuron,cpu:gloo` group)
    has its neuron part set the same way (its backend's `set_timeout`, which also names it
    in its errors), and any gloo part by the stock setter. PyTorch's `fake` backend (torchtitan
    builds its `batch` mesh dimension and those of degree 1 with it) communicates nothing,
    so has no timeout to set."""
    stock = c10d._set_pg_timeout

    @functools.wraps(stock)
    def _set_pg_timeout(timeout: timedelta, group: ProcessGroup | None = None) -> None:
        pg = group if group is not None else c10d._get_default_group()
        if isinstance(pg, ProcessGroup) and not c10d._rank_not_in_group(pg):
            backends = {d.type: pg._get_backend(d) for d in pg._device_types}
            ours = {t for t, b in backends.items() if b.name() == BACKEND}
            for b in {id(backends[t]): backends[t] for t in ours}.values():
                b.set_timeout(timeout)
            if all(t in ours or b.name() == "fake" for t, b in backends.items()):
                return  # nothing left for the stock setter (it would warn); fake has no timeout
        stock(timeout, group)

    setattr(c10d, "_set_pg_timeout", _set_pg_timeout)  # noqa: B010  (a module attribute)


def register() -> None:
    """Registers backend `neuron` for device `neuron` (functional collectives included: c10d
    dispatches them to the group's backend by device)."""
    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    install_hooks()
    from neuronlocal.core import dryrun

    if dryrun.enabled():
        install_dry_rendezvous()
    dist.Backend.register_backend(BACKEND, make_creator(bind_rank), extended_api=True,
                                  devices=["neuron"])
    patching.after_import("torch.testing._internal.distributed.fake_pg", _fake_serves_neuron)
    patching.after_import("torch.distributed.distributed_c10d", _pg_timeout_reaches_neuron)
