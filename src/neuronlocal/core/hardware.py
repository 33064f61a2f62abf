"""Instance profiles: how many logical NeuronCores a process sees, and HBM per core.

Facts from the Neuron architecture pages (sources in docs/estimate.md): a Trainium2 chip
has 8 physical NeuronCore-v3, 96 GiB HBM at 2.9 TB/s, 667 dense BF16 and 181 FP32 TFLOPS;
LNC=2 (the default) pairs the cores into 4 logical cores of 24 GiB, LNC=1 exposes 8 of
12 GiB. A Trainium3 chip has 8 NeuronCore-v4, 144 GiB HBM at 4.9 TB/s, 671 BF16 and 183
FP32 TFLOPS. Trainium (trn1) and Inferentia2 chips have 2 NeuronCore-v2, 32 GiB at 820
GiB/s, 190 BF16 and 47.5 FP32 TFLOPS; TorchNeuron does not run on them, so they are not
emulated, but the cost estimator (neuronlocal.estimate) calibrates on their benchmarks.
The runtime refuses more than 128 visible cores per process (DeviceIndex is int8).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from neuronlocal.core.config import Config, ConfigError
from neuronlocal.core.units import fmt_bytes

GiB = 2**30
MAX_VISIBLE_CORES = 128
# The Config fields that say which cores a process sees: read when the runtime starts.
TOPOLOGY = ("instance", "lnc", "visible_cores", "num_cores", "hbm_per_core")


@dataclass(frozen=True)
class Chip:
    name: str
    physical_cores: int
    hbm_bytes: int
    default_lnc: int
    # Dense peak rates of the whole chip (published figures; the estimator's roofline).
    bf16_flops: float = 0.0
    fp32_flops: float = 0.0
    hbm_bytes_per_s: float = 0.0


TRAINIUM1 = Chip("Trainium", 2, 32 * GiB, 1, 190e12, 47.5e12, 820 * GiB)
INFERENTIA2 = Chip("Inferentia2", 2, 32 * GiB, 1, 190e12, 47.5e12, 820 * GiB)
TRAINIUM2 = Chip("Trainium2", 8, 96 * GiB, 2, 667e12, 181e12, 2.9e12)
TRAINIUM3 = Chip("Trainium3", 8, 144 * GiB, 2, 671e12, 183e12, 4.9e12)

# instance name -> (chip, chips per instance): the instances TorchNeuron runs on. Trn3 ships
# as UltraServers of 16-chip servers (Gen1) or 4-chip servers (Gen2); "trn3.48xlarge" is
# one 16-chip server, "trn3.3xlarge" one chip, and LNC=2 as on Trn2 (not yet published).
INSTANCES: dict[str, tuple[Chip, int]] = {
    "trn2.3xlarge": (TRAINIUM2, 1),
    "trn2.48xlarge": (TRAINIUM2, 16),
    "trn3.3xlarge": (TRAINIUM3, 1),
    "trn3.48xlarge": (TRAINIUM3, 16),
}


@dataclass(frozen=True)
class Profile:
    """What this process sees: the emulated instance after LNC and core visibility."""

    instance: str
    chip: Chip
    chips: int
    lnc: int
    visible: tuple[int, ...]  # instance-wide logical core ids; device i is visible[i]
    hbm_per_core: int

    @property
    def cores_per_chip(self) -> int:
        return self.chip.physical_cores // self.lnc

    @property
    def total_cores(self) -> int:
        return self.cores_per_chip * self.chips

    @property
    def device_count(self) -> int:
        return len(self.visible)

    def describe(self) -> str:
        return f"{self.instance}, LNC={self.lnc}"


def host_memory_note(p: Profile) -> str | None:
    """Why a SIGKILL may be the host's OOM killer rather than a crash: the emulated HBM of
    the visible cores is more than this host's memory (neuron memory is host memory), so
    the host can run out before neuron's OutOfMemoryError; None when it fits."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, KeyError):
        return None
    hbm = p.hbm_per_core * p.device_count
    if host <= 0 or hbm <= host:
        return None
    fits = max(1, host // p.device_count // 2**20)
    return (f"the emulated HBM ({p.device_count} x {fmt_bytes(p.hbm_per_core, 1)}) is more "
            f"than this host's memory ({fmt_bytes(host, 1)}), so the host's OOM killer "
            "(SIGKILL) can end a process before neuron's out-of-memory error; set "
            f"NEURONLOCAL_HBM_PER_CORE={fits}MiB or less to get neuron's error first")


def parse_visible(raw: str, total: int) -> tuple[int, ...]:
    """'0-3' / '2' / '0,2' -> core ids, validated against the instance's core count. Each
    part is checked before a range is expanded, and messages quote at most the start of
    the value: '0-99999999' is one short error, not a list of 10**8 cores."""
    shown = repr(raw) if len(raw) <= 60 else repr(raw[:57] + "...")
    name = f"NEURON_RT_VISIBLE_CORES={shown}"
    cores: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
            if hi < lo:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{name} is not a list of cores: {part[:30]!r} is not a core id "
                              "or range; use e.g. '0-3', '2' or '0,2'.") from None
        if lo < 0 or hi >= total:
            bad = lo if lo < 0 or lo >= total else hi
            raise ConfigError(f"{name} names core(s) [{bad}], but the emulated instance has "
                              f"{total} logical cores; use cores 0 to {total - 1}, e.g. "
                              f"'0-{total - 1}'.")
        cores.extend(range(lo, hi + 1))
        if len(cores) > total:
            break  # more cores than exist: some core is listed twice
    if len(set(cores)) != len(cores):
        raise ConfigError(f"{name} lists a core twice; use each core once, from 0 to "
                          f"{total - 1}.")
    return tuple(cores)


def profile(cfg: Config) -> Profile:
    if cfg.instance not in INSTANCES:
        raise ConfigError(f"NEURONLOCAL_INSTANCE={cfg.instance!r} is unknown; choose one of "
                          f"{', '.join(INSTANCES)}.")
    chip, chips = INSTANCES[cfg.instance]
    lnc = cfg.lnc or chip.default_lnc
    total = chip.physical_cores // lnc * chips
    visible = parse_visible(cfg.visible_cores, total) if cfg.visible_cores else tuple(range(total))
    if cfg.num_cores:
        if cfg.num_cores > len(visible):
            raise ConfigError(f"NEURON_RT_NUM_CORES={str(cfg.num_cores)!r} asks for more "
                              f"logical cores than the {len(visible)} visible; use 1 to "
                              f"{len(visible)}, or 0 for all.")
        visible = visible[:cfg.num_cores]
    if len(visible) > MAX_VISIBLE_CORES:
        raise ConfigError(f"{len(visible)} logical cores are visible, but the Neuron runtime "
                          f"allows at most {MAX_VISIBLE_CORES} per process; set "
                          "NEURON_RT_VISIBLE_CORES (torchrun runs one process per core).")
    hbm = cfg.hbm_per_core or chip.hbm_bytes // (chip.physical_cores // lnc)
    return Profile(cfg.instance, chip, chips, lnc, visible, hbm)


def load(env: Mapping[str, str] | None = None) -> tuple[Config, Profile, ConfigError | None]:
    """Config and profile of the environment, never raising (`import torch` must not fail).

    With bad variables the error names every one of them, and the profile is that of the
    instance (or the default instance) with no visible core, so the device is unavailable.
    """
    cfg, problems = Config.parse_env(env)
    try:
        prof = profile(cfg)
    except ConfigError as e:
        problems.append(str(e))
    if not problems:
        return cfg, prof, None
    known = cfg.instance if cfg.instance in INSTANCES else Config.instance
    fallback = profile(dataclasses.replace(cfg, instance=known, visible_cores=None,
                                           num_cores=None))
    error = ConfigError(" ".join(problems), problems)
    return cfg, dataclasses.replace(fallback, visible=()), error
