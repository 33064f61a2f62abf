"""One configuration object, read from the environment at import (the core variables
again when the device runtime starts, core/state.py).

Every environment variable neuronlocal reads is listed in `ENV_VARS` and read through the
accessors here (`env_str`, `env_flag`, `env_seconds`), which refuse a name not in the table;
README's table is generated from it (`neuronlocal env`), so code and docs
cannot drift apart. TorchNeuron's own names are used wherever TorchNeuron has one.

A bad value never breaks `import torch`: `Config.parse_env` collects one message per bad
variable (name, value, accepted values) and the package then registers the `neuron`
device as unavailable, raising that message when the device is first used. Booleans,
sizes and numbers are parsed here only (`env_flag`, `parse_bytes`, `env_seconds`), so a
value means the same everywhere it is read.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str
    # How the value is checked: flag, size, level, seconds, count (a whole number), calls
    # (a whole number of calls), choice
    # (of `choices`), instance and cores (checked against the instance profile in
    # hardware.py), ccflags (compiler flags, whose optimisation level is checked), routing
    # (a dry run's routing policy), or text.
    kind: str = "text"
    choices: tuple[str, ...] = ()


PLACEMENTS = ("trainium", "native")
COMPILERS = ("eager", "inductor", "tiered")

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("NEURONLOCAL_INSTANCE", "trn2.3xlarge",
           "Emulated instance: trn2.3xlarge, trn2.48xlarge, trn3.3xlarge, trn3.48xlarge.",
           "instance"),
    EnvVar("NEURON_LOGICAL_NC_CONFIG", "instance default (2)",
           "Logical NeuronCore config (LNC): 2 pairs physical cores, 1 exposes each.",
           "choice", ("1", "2")),
    EnvVar("NEURON_RT_VISIBLE_CORES", "all",
           "Logical cores this process sees, e.g. `0-3`, `2`, `0,2`; device i is the i-th. "
           "Read at the first device use, as the core variables above and below are.",
           "cores"),
    EnvVar("NEURON_RT_NUM_CORES", "0 (all)",
           "How many logical cores this process takes: the first N of those visible.",
           "count"),
    EnvVar("NEURON_RT_ENABLE_HOST_CC", "0",
           "1 gives each new `torch.neuron.Stream()` its own stream; by default it is the "
           "device's default stream (TorchNeuron's single-stream mode).", "flag"),
    EnvVar("NEURONLOCAL_HBM_PER_CORE", "instance value",
           "Override HBM per logical core, e.g. `2GiB`, `512MiB` (to test OOM handling).",
           "size"),
    EnvVar("NEURONLOCAL_DOWNCAST_64BIT", "1",
           "Compute float64/int64 as 32-bit and cast back, as Trainium does. 0 keeps 64 bits.",
           "flag"),
    EnvVar("NEURONLOCAL_STRICT", "0",
           "1 turns CPU-fallback ops and float64 compute into errors (for CI).", "flag"),
    EnvVar("NEURONLOCAL_OP_PLACEMENT", "trainium",
           "`trainium`: ops TorchNeuron has no device kernel for are CPU fallbacks (warned, "
           "counted; docs/op-support.md). `native`: every op counts as a device op.",
           "choice", PLACEMENTS),
    EnvVar("TORCH_NEURONX_NEFF_CACHE_DIR", "$TMPDIR/neff_cache_<user>",
           "Persistent compile cache (Inductor artifacts + verified entries). Must be owned "
           "by you and not writable by others; a read-only cache still serves hits."),
    EnvVar("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "$TMPDIR/local_cache_<user>",
           "Lock files that serialise concurrent compiles of one graph (private, like the "
           "cache)."),
    EnvVar("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "600",
           "Seconds to wait for another process compiling the same graph.", "seconds"),
    EnvVar("TORCH_NEURONX_DISABLE_NEFF_CACHE", "0",
           "1 turns the compile cache off (both tiers); nothing is written to its directory.",
           "flag"),
    EnvVar("TORCH_NEURONX_NEFF_DISABLE_CACHE", "0",
           "Alternative spelling of TORCH_NEURONX_DISABLE_NEFF_CACHE.", "flag"),
    EnvVar("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1",
           "A graph that fails to compile raises; 0 runs it eagerly with a warning.", "flag"),
    EnvVar("TORCH_NEURONX_RETAIN_DEVICE_MODE", "0",
           "1 keeps outputs of compiled graphs fed only CPU tensors on the CPU.", "flag"),
    EnvVar("TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY", "0",
           "1 makes CPU tensors passed to a compiled graph an error instead of a copy.", "flag"),
    EnvVar("NEURONLOCAL_DRY_RUN", "0",
           "1: a dry run (`neuronlocal run --dry-run` sets it): neuron tensors carry shapes "
           "and HBM accounting but no bytes, ops run meta kernels, collectives complete "
           "without peers; values read from the device are zeros, except small copies from the "
           "host (docs/dry-run.md).", "flag"),
    EnvVar("NEURONLOCAL_DRY_RUN_ROUTING", "balanced",
           "In a dry run, the indices of topk, sort, argmax and max/min over values the run "
           "does not have (MoE routing): `balanced` (each index as often, +-1, as Megatron's "
           "forced load balancing) or `hot:<fraction>` (that fraction of the rows takes "
           "index 0, e.g. `hot:0.5`; the rest balanced over the others).", "routing"),
    EnvVar("NEURONLOCAL_DRY_RUN_STEPS", "0",
           "In a dry run, stop the program (exit 0) after this many optimizer steps; 0 runs "
           "it to its end (a whole number)."),
    EnvVar("NEURONLOCAL_DIST_CHECKS", "0",
           "1 checks shapes/dtypes of every collective across ranks (clear error; slower).",
           "flag"),
    EnvVar("NEURON_CC_FLAGS", "",
           "Graph compiler flags, as neuronx-cc takes them. The optimisation level is acted "
           "on: `-O1` (or `--optlevel 1`) compiles graphs about 2.5x faster and runs them "
           "slower; `-O2` is the default. Other flags are accepted and have no effect here.",
           "ccflags"),
    EnvVar("NEURONLOCAL_COMPILER", "eager",
           "How compiled graphs run. `eager`: AOTAutograd's graphs run through the neuron eager "
           "path (a compile costs Dynamo's and AOTAutograd's trace, no C++ build). `inductor`: "
           "stock Inductor for CPU builds C++ (slow compiles, faster steady steps for long "
           "runs; NEURON_CC_FLAGS' level picks its settings). `tiered`: `eager` first, stock "
           "Inductor compiled in a background process for graphs called again, switched to "
           "at call NEURONLOCAL_TIER_SWITCH (docs/compile.md).", "choice", COMPILERS),
    EnvVar("NEURONLOCAL_TIER_SWITCH", "300",
           "With NEURONLOCAL_COMPILER=tiered: the call of a graph (shape) from which it runs "
           "Inductor's code, waiting for the background compile if it is not done (results "
           "depend on call counts, never on timing); 0 never switches (a whole number).",
           "calls"),
    EnvVar("NEURONLOCAL_TIER_WORKER_MEMORY", "6GiB",
           "The most memory (data segment) the tiered compiler's background process may use; "
           "past it that compile fails and its graph stays in the first tier.", "size"),
    EnvVar("TORCH_NEURONX_LOG_LEVEL", "0", "3 prints debug logs of the backend.", "level"),
    EnvVar("NEURON_LAUNCH_BLOCKING", "1",
           "Accepted for compatibility; execution on the host is always synchronous.", "flag"),
    EnvVar("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "0",
           "TorchNeuron's build variable (release value 0, set by `import torch_neuronx`); "
           "1 makes `contiguous()` with a memory format other than contiguous/preserve an "
           "error, as in TorchNeuron's development builds.", "flag"),
    EnvVar("TORCH_NEURONX_MLIR_ATEN_OPS", "1",
           "TorchNeuron's build variable (release value 1, set by `import torch_neuronx`); "
           "read by `torch_neuronx.utils.use_mlir_aten_ops`, no other effect here.", "flag"),
    EnvVar("TORCH_DEVICE_BACKEND_AUTOLOAD", "1",
           "PyTorch's switch: 0 stops `import torch` from loading neuronlocal."),
    EnvVar("HF_DEACTIVATE_ASYNC_LOAD", "",
           "transformers' switch: 1 loads weights in the calling thread, as TorchNeuron's "
           "guide sets for multi-rank runs; the run report says when a multi-rank run loaded "
           "weights without it."),
)

_BY_NAME = {v.name: v for v in ENV_VARS}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "k": 2**10, "m": 2**20, "g": 2**30}
MAX_LOG_LEVEL = 3


class ConfigError(ValueError, RuntimeError):
    """A neuronlocal environment variable has a value it cannot use.

    Also a RuntimeError: that is what TorchNeuron raises when no device can be used, and
    what probing code (transformers, accelerate) catches around `torch.neuron.device_count()`.
    `problems` holds one message per bad variable (the message joins them).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def parse_flag(name: str, raw: str | None, default: bool) -> bool:
    """The one boolean rule: 1/true/yes/on or 0/false/no/off (any case); unset or empty
    means the default; anything else is a ConfigError naming the variable."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0 (true/false, yes/no and "
                      "on/off are accepted too).")


def _known(name: str) -> EnvVar:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in ENV_VARS (neuronlocal/core/config.py); add it there."
                       ) from None


def env_str(name: str) -> str | None:
    """The raw value of a listed variable, stripped; None when unset or empty."""
    _known(name)
    raw = os.environ.get(name)
    return raw.strip() if raw is not None and raw.strip() else None


def env_flag(name: str, default: bool | None = None) -> bool:
    """A boolean variable read now (for settings that may change while a program runs)."""
    if default is None:
        default = parse_flag(name, _known(name).default, False)
    return parse_flag(name, os.environ.get(name), default)


# The largest size and number of seconds accepted: far past any device or wait, and small
# enough that every C type a value reaches (int64 budgets, double timeouts) holds it.
MAX_BYTES = 2**50
MAX_SECONDS = 10**9
_INTEGER = re.compile(r"[0-9]+")


def parse_bytes(name: str, raw: str) -> int:
    """'2GiB' -> 2147483648, up to MAX_BYTES. Raises ConfigError naming the variable on bad
    input (integers are read exactly, so a value just past a C type's range is refused)."""
    text = raw.strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):]
    try:
        value: float = int(digits) if _INTEGER.fullmatch(digits) else float(digits)
    except ValueError:
        value = -1.0
    ok = unit in _UNITS and 0 < value <= MAX_BYTES  # False for nan and inf
    if not ok or not 0 < int(value * _UNITS[unit]) <= MAX_BYTES:
        raise ConfigError(f"{name}={raw!r} is not a size; use a positive size up to 1PiB such "
                          "as 24GiB, 512MiB or a byte count.")
    return int(value * _UNITS[unit])


def parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_SECONDS:  # False for nan and inf
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; use e.g. 600 (0 to "
                          f"{MAX_SECONDS}).")
    return value


def env_seconds(name: str) -> float:
    """A listed number of seconds (its table default when unset)."""
    return parse_seconds(name, env_str(name) or _known(name).default)


def env_size(name: str) -> int:
    """A listed size in bytes (its table default when unset)."""
    return parse_bytes(name, env_str(name) or _known(name).default)


def parse_calls(name: str, raw: str) -> int:
    text = raw.strip()
    if not _INTEGER.fullmatch(text) or int(text) > 10**12:
        raise ConfigError(f"{name}={raw!r} is not a call count; use a whole number such as "
                          "300 (0 turns it off).")
    return int(text)


def env_calls(name: str) -> int:
    """A listed call count (its table default when unset)."""
    return parse_calls(name, env_str(name) or _known(name).default)


def parse_level(name: str, raw: str) -> int:
    text = raw.strip()
    if not _INTEGER.fullmatch(text):
        raise ConfigError(f"{name}={raw!r} is not a log level; use 0 (off) to {MAX_LOG_LEVEL} "
                          "(debug).")
    if int(text) > MAX_LOG_LEVEL:
        raise ConfigError(f"{name}={raw!r} is not a log level; use 0 (off) to {MAX_LOG_LEVEL} "
                          "(debug).")
    return int(text)


OPT_LEVELS = (1, 2, 3)  # neuronx-cc's optimisation levels
DEFAULT_OPT_LEVEL = 2
_OPT_FLAG = re.compile(r"^(?:-O|--optlevel=?)(.*)$")


def parse_optlevel(name: str, raw: str) -> int:
    """The optimisation level in compiler flags, read as neuronx-cc reads it: `-O1`,
    `--optlevel 1` or `--optlevel=1`, the last one winning; 2 when none is given."""
    try:
        tokens = shlex.split(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r} cannot be split into flags ({e}); use "
                          "balanced quotes.") from None
    level, i = str(DEFAULT_OPT_LEVEL), 0
    while i < len(tokens):
        match = _OPT_FLAG.match(tokens[i])
        if match:
            value = match.group(1)
            if not value and tokens[i] == "--optlevel" and i + 1 < len(tokens):
                i += 1
                value = tokens[i]
            level = value
        i += 1
    if level not in {str(n) for n in OPT_LEVELS}:
        raise ConfigError(f"{name}={raw!r} sets optimisation level {level!r}; use -O1, -O2 or "
                          "-O3 (or --optlevel 1, 2, 3).")
    return int(level)


def env_compiler() -> str:
    """Which compiler runs torch.compile graphs (NEURONLOCAL_COMPILER), read now."""
    value = env_str("NEURONLOCAL_COMPILER") or _known("NEURONLOCAL_COMPILER").default
    _check(_known("NEURONLOCAL_COMPILER"), value)
    return value


def env_optlevel() -> int:
    """The graph compiler's optimisation level from NEURON_CC_FLAGS, read now."""
    return parse_optlevel("NEURON_CC_FLAGS", env_str("NEURON_CC_FLAGS") or "")


def parse_routing(name: str, raw: str) -> float:
    """A dry run's routing policy: -1 for `balanced`, else the hot fraction of `hot:<f>`."""
    value = raw.strip().lower()
    if value == "balanced":
        return -1.0
    head, _, frac = value.partition(":")
    try:
        hot = float(frac) if head == "hot" else -1.0
    except ValueError:
        hot = -1.0
    if not 0.0 <= hot <= 1.0:
        raise ConfigError(f"{name}={raw!r} is not a routing policy; use `balanced` or "
                          "`hot:<fraction>` with a fraction from 0 to 1, e.g. hot:0.5.")
    return hot


def _check(var: EnvVar, raw: str) -> None:
    """Raises ConfigError when `raw` is not a value `var` accepts (kinds checked here)."""
    if var.kind == "flag":
        parse_flag(var.name, raw, False)
    elif var.kind == "size":
        parse_bytes(var.name, raw)
    elif var.kind == "seconds":
        parse_seconds(var.name, raw)
    elif var.kind == "level":
        parse_level(var.name, raw)
    elif var.kind == "ccflags":
        parse_optlevel(var.name, raw)
    elif var.kind == "calls":
        parse_calls(var.name, raw)
    elif var.kind == "routing":
        parse_routing(var.name, raw)
    elif var.kind == "count" and not _INTEGER.fullmatch(raw.strip()):
        raise ConfigError(f"{var.name}={raw!r} is not a number of cores; use a whole number "
                          "such as 1 or 4 (0 means all).")
    elif var.kind == "choice" and raw.strip() not in var.choices:
        raise ConfigError(f"{var.name}={raw!r} is not supported; use {' or '.join(var.choices)}.")


@dataclass(frozen=True)
class Config:
    instance: str = "trn2.3xlarge"
    lnc: int | None = None
    visible_cores: str | None = None
    num_cores: int | None = None
    hbm_per_core: int | None = None
    downcast_64bit: bool = True
    strict: bool = False
    placement: str = "trainium"
    log_level: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse_env(cls, env: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
        """The config of `env` (default os.environ) and one message per bad variable; a bad
        variable keeps its default, so the result is always usable for reporting."""
        env = os.environ if env is None else env
        problems: list[str] = []
        good: dict[str, str] = {}
        for var in ENV_VARS:
            raw = env.get(var.name)
            if raw is None or not raw.strip():
                continue
            try:
                _check(var, raw)
            except ConfigError as e:
                problems.append(str(e))
                continue
            good[var.name] = raw.strip()
        hbm = good.get("NEURONLOCAL_HBM_PER_CORE")
        lnc = good.get("NEURON_LOGICAL_NC_CONFIG")
        num = good.get("NEURON_RT_NUM_CORES")
        cfg = cls(
            instance=good.get("NEURONLOCAL_INSTANCE", "trn2.3xlarge"),
            lnc=int(lnc) if lnc else None,
            visible_cores=good.get("NEURON_RT_VISIBLE_CORES"),
            num_cores=(int(num) or None) if num else None,
            hbm_per_core=parse_bytes("NEURONLOCAL_HBM_PER_CORE", hbm) if hbm else None,
            downcast_64bit=parse_flag("NEURONLOCAL_DOWNCAST_64BIT",
                                      good.get("NEURONLOCAL_DOWNCAST_64BIT"), True),
            strict=parse_flag("NEURONLOCAL_STRICT", good.get("NEURONLOCAL_STRICT"), False),
            placement=good.get("NEURONLOCAL_OP_PLACEMENT", "trainium"),
            log_level=parse_level("TORCH_NEURONX_LOG_LEVEL",
                                  good.get("TORCH_NEURONX_LOG_LEVEL", "0")),
        )
        return cfg, problems

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Like `parse_env`, but a bad variable is a ConfigError (all problems in one line)."""
        cfg, problems = cls.parse_env(env)
        if problems:
            raise ConfigError(" ".join(problems), problems)
        return cfg


def set_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, value) of every variable of ENV_VARS that is set, in table order."""
    env = os.environ if env is None else env
    return [(v.name, env[v.name]) for v in ENV_VARS if v.name in env]


def env_table_markdown() -> str:
    """The env-var table for README.md and docs (kept in sync by a test)."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in ENV_VARS]
    return "\n".join(rows)
