"""Instance profiles and the env vars that select them."""

from __future__ import annotations

import re

import pytest

from neuronlocal.core import hardware
from neuronlocal.core.config import Config, ConfigError, parse_bytes

GiB = 2**30


@pytest.mark.parametrize(("instance", "lnc", "cores", "hbm"), [
    ("trn2.3xlarge", None, 4, 24 * GiB),
    ("trn2.3xlarge", 1, 8, 12 * GiB),
    ("trn2.48xlarge", None, 64, 24 * GiB),
    ("trn2.48xlarge", 1, 128, 12 * GiB),
    ("trn3.3xlarge", None, 4, 36 * GiB),
])
def test_profiles(instance, lnc, cores, hbm):
    p = hardware.profile(Config(instance=instance, lnc=lnc))
    assert p.device_count == cores and p.hbm_per_core == hbm


@pytest.mark.parametrize(("raw", "cores"), [("0-3", (0, 1, 2, 3)), ("2", (2,)), ("0,2", (0, 2))])
def test_visible_cores(raw, cores):
    assert hardware.profile(Config(visible_cores=raw)).visible == cores


@pytest.mark.parametrize("raw", ["5", "3-1", "a", "0,0"])
def test_bad_visible_cores(raw):
    with pytest.raises(ConfigError, match="NEURON_RT_VISIBLE_CORES"):
        hardware.profile(Config(visible_cores=raw))


def test_bad_instance_and_lnc(monkeypatch):
    with pytest.raises(ConfigError, match="NEURONLOCAL_INSTANCE"):
        hardware.profile(Config(instance="p5.48xlarge"))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "8")
    with pytest.raises(ConfigError, match="NEURON_LOGICAL_NC_CONFIG"):
        Config.from_env()


def test_parse_bytes():
    assert parse_bytes("X", "2GiB") == 2 * GiB
    assert parse_bytes("X", "512MiB") == 512 * 2**20
    with pytest.raises(ConfigError, match="X="):
        parse_bytes("X", "lots")


def test_env_selects_profile(fresh_python):
    r = fresh_python("import torch; print(torch.neuron.device_count(), "
                     "torch.neuron.get_device_properties(0).total_memory)",
                     env={"NEURONLOCAL_INSTANCE": "trn2.48xlarge", "NEURON_LOGICAL_NC_CONFIG": "1",
                          "NEURON_RT_VISIBLE_CORES": "4-7"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", str(12 * GiB)]


def test_hbm_above_host_memory_is_said_with_the_fix(monkeypatch):
    """The default HBM per core can exceed this host's RAM: then the host's OOM killer may end
    a process before neuron's OutOfMemoryError, and the note says so with a size that fits."""
    import os

    from neuronlocal.core import hardware as hw

    prof = hw.profile(Config.from_env({}))
    total = prof.hbm_per_core * prof.device_count
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                                                     "SC_PHYS_PAGES": total // 2 // 4096}[name])
    note = hw.host_memory_note(prof)
    assert note is not None and "OOM killer" in note and "NEURONLOCAL_HBM_PER_CORE" in note
    fix = re.search(r"NEURONLOCAL_HBM_PER_CORE=(\d+)MiB", note)
    assert fix, note
    fitted = hw.profile(Config.from_env({"NEURONLOCAL_HBM_PER_CORE": fix.group(0).split("=")[1]}))
    assert hw.host_memory_note(fitted) is None  # the advice, applied, silences the note
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                                                     "SC_PHYS_PAGES": 2 * total // 4096}[name])
    assert hw.host_memory_note(prof) is None
