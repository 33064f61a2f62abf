"""The Neuron runtime's inspect (profiling) configuration API, as TorchNeuron binds it.

`NeuronProfiler` drives a runtime profiling session through these calls: allocate a
config, set its defaults, output directory, inspect switch and capture filters, begin,
stop. Each returns the runtime's status code (0 on success). Here the session is kept on
the host: the calls check their arguments and state as the runtime does (a bad core, a
second `begin`, a `stop` without `begin` give a non-zero status) and `begin` creates the
output directory, but no device exists, so no system or device trace is written into it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# The runtime's status codes these calls return (nrt_status_t).
NRT_SUCCESS = 0
NRT_FAILURE = 1
NRT_INVALID = 2

# Physical NeuronCores of the largest Trainium instance a filter may name (trn2.48xlarge:
# 16 chips of 8 cores).
MAX_NEURON_CORES = 128


@dataclass
class InspectConfig:
    """One profiling session's options (the runtime's nrt_inspect_config_t)."""

    output_dir: str | None = None
    enabled: bool = False
    defaults_set: bool = False
    cores: set[int] = field(default_factory=set)
    event_types: set[str] = field(default_factory=set)


_active: InspectConfig | None = None


def _nrt_inspect_config_allocate() -> InspectConfig:
    return InspectConfig()


def _nrt_inspect_config_set_defaults(config: InspectConfig) -> int:
    if not isinstance(config, InspectConfig):
        return NRT_INVALID
    config.output_dir, config.enabled, config.defaults_set = None, False, True
    config.cores.clear()
    config.event_types.clear()
    return NRT_SUCCESS


def _nrt_inspect_config_set_output_dir(config: InspectConfig, output_dir: str) -> int:
    if not isinstance(config, InspectConfig) or not isinstance(output_dir, str) or not output_dir:
        return NRT_INVALID
    config.output_dir = output_dir
    return NRT_SUCCESS


def _nrt_inspect_config_set_enable_inspect(config: InspectConfig, enable: bool) -> int:
    if not isinstance(config, InspectConfig):
        return NRT_INVALID
    config.enabled = bool(enable)
    return NRT_SUCCESS


def _nrt_inspect_config_set_capture_enabled_for_nc(config: InspectConfig, nc: int,
                                                   enable: bool) -> int:
    """Captures (or stops capturing) events of physical NeuronCore `nc`."""
    if not isinstance(config, InspectConfig) or not isinstance(nc, int):
        return NRT_INVALID
    if not 0 <= nc < MAX_NEURON_CORES:
        return NRT_INVALID
    (config.cores.add if enable else config.cores.discard)(nc)
    return NRT_SUCCESS


def _nrt_inspect_config_set_capture_enabled_for_event_type_string(
        config: InspectConfig, event_type: str, enable: bool) -> int:
    """Captures (or stops capturing) one event type, named as the runtime names it."""
    if not isinstance(config, InspectConfig) or not isinstance(event_type, str):
        return NRT_INVALID
    if not event_type.strip():
        return NRT_INVALID
    (config.event_types.add if enable else config.event_types.discard)(event_type.strip())
    return NRT_SUCCESS


def _nrt_inspect_begin_with_options(config: InspectConfig) -> int:
    """Starts the session: one at a time, with an output directory and inspect enabled."""
    global _active
    if not isinstance(config, InspectConfig) or _active is not None:
        return NRT_INVALID
    if not config.enabled or not config.output_dir:
        return NRT_INVALID
    try:
        os.makedirs(config.output_dir, exist_ok=True)
    except OSError:
        return NRT_FAILURE
    _active = config
    return NRT_SUCCESS


def _nrt_inspect_stop() -> int:
    global _active
    if _active is None:
        return NRT_INVALID
    _active = None
    return NRT_SUCCESS


def active_session() -> InspectConfig | None:
    """The session begun and not yet stopped, if any."""
    return _active
