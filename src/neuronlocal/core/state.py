"""This process's configuration, instance profile and configuration error.

The configuration is read from the environment when this module is first imported (by
`neuronlocal/__init__.py`); it is changed only by `set_config()` (`eager.set_policy`). The
instance profile (how many cores this process sees, their HBM) and the configuration error
are read when the device runtime starts, at the first device use, as TorchNeuron's runtime
reads NEURON_RT_VISIBLE_CORES when it starts: a program may set the core variables after
`import torch`. From the start on they are fixed. Reading `profile` or `config_error` starts
the runtime. Nothing here raises: a bad variable is kept in `config_error`, and the device
has no visible core. Every layer reads them here, so none has to import the top-level
package; `neuronlocal.config`, `.profile` and `.config_error` read the same values.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from neuronlocal.core import hardware
from neuronlocal.core.config import Config, ConfigError

config: Config = Config.parse_env()[0]
# Set by start(); until then reading them starts the runtime (module __getattr__).
profile: hardware.Profile
config_error: ConfigError | None

_lock = threading.RLock()
_starting = False
_pending: list[Callable[[], None]] = []


def set_config(new: Config) -> None:
    """Replaces the process's config (run-time policy changes)."""
    global config
    config = new


def started() -> bool:
    return "profile" in globals()


def start() -> None:
    """Starts the device runtime, once: reads the core topology from the environment as it
    is now and hands it to the C++ core. Called by the C++ core at the first device use (from
    any thread); a call made while this thread is starting returns at once."""
    global config, profile, config_error, _starting
    if started():
        return
    with _lock:
        if started() or _starting:
            return
        _starting = True
        try:
            cfg, prof, error = hardware.load()
            config = dataclasses.replace(config, **{f: getattr(cfg, f) for f in hardware.TOPOLOGY})
            from neuronlocal import _C

            n = prof.device_count
            _C._start(n, [prof.hbm_per_core] * n, prof.describe(),
                      f"neuron device unavailable: {error}" if error else "")
            profile, config_error = prof, error
        finally:
            _starting = False
        pending = list(_pending)
        _pending.clear()
    for fn in pending:
        fn()


def when_started(fn: Callable[[], None]) -> None:
    """Runs `fn` now if the runtime has started, else right after it starts (as CUDA queues
    seeding until its first use), so seeding does not fix the core count."""
    with _lock:
        if not started():
            _pending.append(fn)
            return
    fn()


def __getattr__(name: str) -> Any:
    if name in ("profile", "config_error"):
        start()
        if started():
            return globals()[name]
        raise AttributeError(f"{name} is read while the device runtime starts")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
