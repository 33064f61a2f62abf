"""One configuration object, read from the environment once at import.

Every environment variable neuronlocal reads is listed in `ENV_VARS`; the table in
README.md and docs/env-vars.md is generated from it (`neuronlocal env`), so code and docs
cannot drift apart. TorchNeuron's own names are used wherever TorchNeuron has one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("NEURONLOCAL_INSTANCE", "trn2.3xlarge",
           "Emulated instance: trn2.3xlarge, trn2.48xlarge, trn3.3xlarge, trn3.48xlarge."),
    EnvVar("NEURON_LOGICAL_NC_CONFIG", "instance default (2)",
           "Logical NeuronCore config (LNC): 2 pairs physical cores, 1 exposes each."),
    EnvVar("NEURON_RT_VISIBLE_CORES", "all",
           "Logical cores this process sees, e.g. `0-3`, `2`, `0,2`; device i is the i-th."),
    EnvVar("NEURONLOCAL_HBM_PER_CORE", "instance value",
           "Override HBM per logical core, e.g. `2GiB`, `512MiB` (to test OOM handling)."),
    EnvVar("NEURONLOCAL_DOWNCAST_64BIT", "1",
           "Compute float64/int64 as 32-bit and cast back, as Trainium does. 0 keeps 64 bits."),
    EnvVar("NEURONLOCAL_STRICT", "0",
           "1 turns CPU-fallback ops and float64 compute into errors (for CI)."),
    EnvVar("NEURONLOCAL_OP_PLACEMENT", "trainium",
           "`trainium`: ops TorchNeuron has no device kernel for are CPU fallbacks (warned, "
           "counted; docs/op-support.md). `native`: every op counts as a device op."),
    EnvVar("TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/neff_cache",
           "Persistent compile cache (entries + Inductor artifacts); share it between runs."),
    EnvVar("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "/tmp/local_cache",
           "Lock files that serialise concurrent compiles of one graph."),
    EnvVar("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "600",
           "Seconds to wait for another process compiling the same graph."),
    EnvVar("TORCH_NEURONX_DISABLE_NEFF_CACHE", "0", "1 turns the compile cache off (both tiers)."),
    EnvVar("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1",
           "A graph that fails to compile raises; 0 runs it eagerly with a warning."),
    EnvVar("TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY", "0",
           "1 makes CPU tensors passed to a compiled graph an error instead of a copy."),
    EnvVar("NEURONLOCAL_DIST_CHECKS", "0",
           "1 checks shapes/dtypes of every collective across ranks (clear error; slower)."),
    EnvVar("TORCH_NEURONX_LOG_LEVEL", "0", "3 prints debug logs of the backend."),
    EnvVar("NEURON_LAUNCH_BLOCKING", "1",
           "Accepted for compatibility; execution on the host is always synchronous."),
    EnvVar("TORCH_DEVICE_BACKEND_AUTOLOAD", "1",
           "PyTorch's switch: 0 stops `import torch` from loading neuronlocal."),
)

PLACEMENTS = ("trainium", "native")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "k": 2**10, "m": 2**20, "g": 2**30}


class ConfigError(ValueError):
    """A neuronlocal environment variable has a value it cannot use."""


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0.")


def parse_bytes(name: str, raw: str) -> int:
    """'2GiB' -> 2147483648. Raises ConfigError naming the variable on bad input."""
    text = raw.strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if value <= 0 or unit not in _UNITS:
        raise ConfigError(f"{name}={raw!r} is not a size; use e.g. 24GiB, 512MiB or a byte count.")
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class Config:
    instance: str = "trn2.3xlarge"
    lnc: int | None = None
    visible_cores: str | None = None
    hbm_per_core: int | None = None
    downcast_64bit: bool = True
    strict: bool = False
    placement: str = "trainium"
    log_level: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Config:
        env = os.environ
        lnc_raw = env.get("NEURON_LOGICAL_NC_CONFIG")
        lnc = None
        if lnc_raw is not None and lnc_raw.strip():
            if lnc_raw.strip() not in {"1", "2"}:
                raise ConfigError(f"NEURON_LOGICAL_NC_CONFIG={lnc_raw!r} is not supported; "
                                  "Trainium supports 1 or 2 (2 is the default).")
            lnc = int(lnc_raw)
        hbm_raw = env.get("NEURONLOCAL_HBM_PER_CORE")
        level_raw = env.get("TORCH_NEURONX_LOG_LEVEL", "0").strip() or "0"
        if not level_raw.isdigit():
            raise ConfigError(f"TORCH_NEURONX_LOG_LEVEL={level_raw!r} is not a number (0-3).")
        placement = env.get("NEURONLOCAL_OP_PLACEMENT", "trainium").strip().lower() or "trainium"
        if placement not in PLACEMENTS:
            raise ConfigError(f"NEURONLOCAL_OP_PLACEMENT={placement!r} is not a placement; use "
                              "'trainium' (TorchNeuron's CPU fallbacks) or 'native' (none).")
        return cls(
            instance=env.get("NEURONLOCAL_INSTANCE", "trn2.3xlarge").strip() or "trn2.3xlarge",
            lnc=lnc,
            visible_cores=(env.get("NEURON_RT_VISIBLE_CORES") or "").strip() or None,
            hbm_per_core=parse_bytes("NEURONLOCAL_HBM_PER_CORE", hbm_raw) if hbm_raw else None,
            downcast_64bit=_flag("NEURONLOCAL_DOWNCAST_64BIT", True),
            strict=_flag("NEURONLOCAL_STRICT", False),
            placement=placement,
            log_level=int(level_raw),
        )


def env_table_markdown() -> str:
    """The env-var table for README.md and docs (kept in sync by a test)."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in ENV_VARS]
    return "\n".join(rows)
