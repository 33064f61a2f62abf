"""Configuration: every environment variable, good and bad values, and what a bad one does.

A bad value never breaks `import torch` (or CPU work, seeding, torchrun): the `neuron`
device is unavailable and its first use raises one line naming the variable, the value
and the accepted values; `is_available()` is False (warned once); `neuronlocal env` and
`neuronlocal info` show the error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neuronlocal import compile as _compile  # noqa: F401  (compile.cache below)
from neuronlocal.compile import cache
from neuronlocal.core import hardware
from neuronlocal.core.config import (
    ENV_VARS,
    Config,
    ConfigError,
    env_flag,
    env_seconds,
    parse_flag,
    parse_optlevel,
)
from neuronlocal.distributed.backend import checks_enabled

# Bad values per kind of variable (every kind in ENV_VARS must be here: a new kind needs its
# bad values). The first one of each is used in the subprocess test; the issue's examples
# come first.
BAD: dict[str, list[str]] = {
    "instance": ["trn9.huge", "p5.48xlarge"],
    "choice": ["3", "0", "two"],
    "cores": ["99", "0-99", "3-1", "a", "0,0", "0-3,"],
    "count": ["many", "-1", "1.5", "5"],  # 5: more than the default instance's 4 cores
    # values outside every C type's range: int64, uint64, double (1e400 is inf)
    "size": ["0", "lots", "-5MiB", "2XB", "nan", "9223372036854775808", "1e19", "1e400",
             "18446744073709551616", "-9223372036854775809", "inf", "99999999999GiB"],
    "flag": ["maybe", "2", "yes please"],
    "seconds": ["soon", "-1", "inf", "nan", "1e400", "1e19"],
    "level": ["banana", "-1", "3.5", "99", "4", "9223372036854775808"],
    "ccflags": ["-O7", "--optlevel fast", "--target trn2 -O", "--optlevel", "'-O1"],
    "calls": ["soon", "-1", "2.5", "1e3", "10000000000000"],
    "routing": ["hot:2", "hot", "hot:-0.1", "cold:0.5", "balanced:1", "hot:nan"],
}
GOOD: dict[str, list[str]] = {
    "instance": ["trn2.48xlarge", "trn3.3xlarge"],
    "choice": [],  # from each variable's own choices (_good_cases)
    "cores": ["0-3", "2", "0,2"],
    "count": ["1", "4", "0"],
    "size": ["2GiB", "512MiB", "1000000", "10MiB"],
    "flag": ["1", "0", "TRUE", "off", "Yes", ""],
    "seconds": ["0", "600", "2.5"],
    "level": ["0", "3", " 2 "],
    "ccflags": ["-O1", "--optlevel 1", "--optlevel=3 --model-type transformer",
                "--target trn2 -O2", ""],
    "calls": ["0", "300", " 16 "],
    "routing": ["balanced", "hot:0.5", "HOT:1", " hot:0 "],
}
ISSUE_VALUES = {"NEURON_RT_VISIBLE_CORES": "99", "NEURONLOCAL_INSTANCE": "trn9.huge",
                "NEURON_LOGICAL_NC_CONFIG": "3", "NEURONLOCAL_HBM_PER_CORE": "0",
                "TORCH_NEURONX_LOG_LEVEL": "banana", "NEURONLOCAL_STRICT": "maybe"}
CHECKED = [v for v in ENV_VARS if v.kind != "text"]


def _bad_cases() -> list[tuple[str, str]]:
    return [(v.name, raw) for v in CHECKED for raw in BAD[v.kind]]


def test_every_kind_has_bad_and_good_values():
    kinds = {v.kind for v in ENV_VARS}
    assert kinds - {"text"} <= set(BAD) and kinds - {"text"} <= set(GOOD), kinds
    assert set(ISSUE_VALUES) <= {v.name for v in CHECKED}


@pytest.mark.parametrize(("name", "raw"), _bad_cases())
def test_bad_value_is_one_line_naming_variable_value_and_fix(name, raw):
    cfg, prof, err = hardware.load({name: raw})
    assert err is not None, f"{name}={raw!r} was accepted"
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(f"{name}={raw!r} "), msg
    # the accepted values: "use ..." or "choose one of ..."
    assert re.search(r"; (use|choose one of) \S", msg), msg
    assert prof.device_count == 0  # the device is unavailable, with a usable profile
    assert isinstance(err, RuntimeError) and isinstance(err, ValueError)
    with pytest.raises(ConfigError, match=re.escape(name)):
        hardware.profile(Config.from_env({name: raw}))


def _good_cases() -> list[tuple[str, str]]:
    """GOOD per kind; a choice variable's own choices, the last one padded with spaces."""
    return [(v.name, raw) for v in CHECKED
            for raw in (GOOD[v.kind] or [*v.choices[:-1], f" {v.choices[-1]} "])]


@pytest.mark.parametrize(("raw", "level"), [
    ("", 2), ("-O1", 1), ("--optlevel 1", 1), ("--optlevel=3", 3), ("-O3 -O1", 1),
    ("--model-type transformer --auto-cast none", 2), ("--target trn2 --optlevel 1 -O2", 2)])
def test_optimisation_level_is_read_as_neuronx_cc_reads_it(raw, level):
    assert parse_optlevel("NEURON_CC_FLAGS", raw) == level


@pytest.mark.parametrize(("name", "raw"), _good_cases())
def test_good_values_are_accepted(name, raw):
    cfg, prof, err = hardware.load({name: raw})
    assert err is None, err
    assert prof.device_count > 0


def test_text_variables_accept_anything():
    env = {v.name: "\t/some where/\u00e9" for v in ENV_VARS if v.kind == "text"}
    assert hardware.load(env)[2] is None


def test_all_problems_are_reported_together():
    _, _, err = hardware.load({"NEURONLOCAL_STRICT": "maybe", "TORCH_NEURONX_LOG_LEVEL": "x",
                               "NEURON_RT_VISIBLE_CORES": "99"})
    msg = str(err)
    assert "NEURONLOCAL_STRICT='maybe'" in msg and "TORCH_NEURONX_LOG_LEVEL='x'" in msg
    assert "NEURON_RT_VISIBLE_CORES='99'" in msg and "\n" not in msg


def test_values_parse_to_the_config():
    cfg, prof, err = hardware.load({"NEURONLOCAL_INSTANCE": "trn2.48xlarge",
                                    "NEURON_LOGICAL_NC_CONFIG": "1",
                                    "NEURON_RT_VISIBLE_CORES": "4-7",
                                    "NEURONLOCAL_HBM_PER_CORE": "512MiB",
                                    "NEURONLOCAL_DOWNCAST_64BIT": "off",
                                    "NEURONLOCAL_STRICT": "on", "TORCH_NEURONX_LOG_LEVEL": "2"})
    assert err is None
    assert (cfg.lnc, cfg.downcast_64bit, cfg.strict, cfg.log_level) == (1, False, True, 2)
    assert prof.visible == (4, 5, 6, 7) and prof.hbm_per_core == 512 * 2**20


# ---- the one boolean rule ---------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "want"), [("1", True), ("true", True), ("YES", True),
                                           (" on ", True), ("0", False), ("False", False),
                                           ("no", False), ("OFF", False), ("", None),
                                           (None, None)])
def test_parse_flag(raw, want):
    for default in (True, False):
        assert parse_flag("X", raw, default) is (default if want is None else want)


@pytest.mark.parametrize("read", [
    lambda: env_flag("TORCH_NEURONX_DISABLE_NEFF_CACHE"),
    cache.disabled,
    checks_enabled,
    lambda: env_flag("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"),
])
def test_every_boolean_reader_uses_the_one_rule(monkeypatch, read):
    for name in ("TORCH_NEURONX_DISABLE_NEFF_CACHE", "NEURONLOCAL_DIST_CHECKS",
                 "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"):
        monkeypatch.setenv(name, "maybe")
    with pytest.raises(ConfigError, match=r"='maybe' is not a boolean; use 1 or 0"):
        read()
    for name in ("TORCH_NEURONX_DISABLE_NEFF_CACHE", "NEURONLOCAL_DIST_CHECKS",
                 "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"):
        monkeypatch.setenv(name, "Yes")
    assert read() is True


def test_no_module_parses_booleans_itself():
    """One parser: no module that reads the environment compares a value with 'true'/'yes'
    (config files' own booleans, e.g. in support/configs.py, are not environment values)."""
    src = Path(__file__).parents[1] / "src" / "neuronlocal"
    pattern = re.compile(r"""["'](true|yes)["']""")
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if p.name != "config.py" and "environ" in (text := p.read_text())
                 and pattern.search(text)]
    assert offenders == []


def test_no_module_reads_a_variable_behind_config():
    """Variables are read through config's accessors: no other module reads a TorchNeuron,
    Neuron runtime or neuronlocal variable from os.environ itself."""
    src = Path(__file__).parents[1] / "src" / "neuronlocal"
    pattern = re.compile(r"""(environ\.get\(|getenv\(|environ\[)["'](NEURON|TORCH_NEURONX)\w*["']"""
                         r"""(?!\]\s*=[^=])""")
    offenders = [f"{p.relative_to(src)}: {m.group(0)}" for p in src.rglob("*.py")
                 if p.name != "config.py" for m in pattern.finditer(p.read_text())]
    assert offenders == []


def test_lock_timeout_uses_the_seconds_rule(monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT='soon'"):
        cache.lock_timeout()
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "12")
    assert env_seconds("TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT") == 12.0


# ---- a bad variable in a real process -----------------------------------------------------------

PROBE = r"""
import json, sys, warnings
import torch

out = {"cpu": torch.ones(2).sum().item()}
torch.manual_seed(0)                  # seeds every registered device: must keep working
out["randn"] = torch.randn(2).shape[0]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["available"] = torch.neuron.is_available()
    torch.neuron.is_available()
out["warnings"] = [str(x.message) for x in w]
out["accelerator"] = torch.accelerator.is_available()
x = torch.ones(3, requires_grad=True)
(x * 2).sum().backward()                # CPU autograd (the engine asks every device)
out["grad"] = x.grad.tolist()

def first_use(name, fn):
    try:
        fn()
        out[name] = None
    except Exception as e:  # noqa: BLE001
        out[name] = [type(e).__name__, isinstance(e, RuntimeError), str(e)]

first_use("tensor", lambda: torch.ones(2, device="neuron"))
first_use("empty0", lambda: torch.empty(0, device="neuron:0"))
first_use("to", lambda: torch.zeros(2).to("neuron"))
first_use("device_count", torch.neuron.device_count)
first_use("set_device", lambda: torch.neuron.set_device(0))
first_use("current_device", torch.neuron.current_device)
first_use("memory", torch.neuron.memory_allocated)
first_use("compile", lambda: torch.compile(lambda t: t + 1, backend="neuron")(torch.ones(2)))
def group():
    import torch.distributed as dist
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1)
first_use("process_group", group)
import transformers.utils.import_utils as iu
out["transformers"] = [iu.is_torch_neuron_available(), iu.is_torch_neuron_available(True)]
print("RESULT" + json.dumps(out))
"""

USES = ["tensor", "empty0", "to", "device_count", "set_device", "current_device", "memory",
        "compile", "process_group"]


def _probe(fresh_python, env: dict[str, str]) -> dict:
    r = fresh_python(PROBE, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("var", CHECKED, ids=lambda v: v.name)
def test_bad_variable_never_breaks_import_and_fails_first_use(fresh_python, var):
    raw = ISSUE_VALUES.get(var.name, BAD[var.kind][0])
    out = _probe(fresh_python, {var.name: raw})
    assert out["cpu"] == 2.0 and out["randn"] == 2 and out["grad"] == [2.0, 2.0, 2.0]
    assert out["available"] is False and out["accelerator"] is False
    expected = f"neuron device unavailable: {var.name}={raw!r} "
    assert len(out["warnings"]) == 1 and out["warnings"][0].startswith(expected)
    for use in USES:
        got = out[use]
        assert got is not None, f"{use} worked with {var.name}={raw!r}"
        kind, is_runtime, msg = got
        assert is_runtime, got
        assert expected in msg, (use, msg)
        line = next(ln for ln in msg.splitlines() if expected in ln)
        assert re.search(r"; (use|choose one of) \S", line), line
        if use not in ("compile",):  # Dynamo wraps backend errors in its own lines
            assert "\n" not in msg.strip(), (use, msg)
    assert out["transformers"] == [False, False]


@pytest.mark.parametrize("raw", ["9223372036854775808", "1e19", "1e400"])
def test_sizes_outside_every_c_range_never_break_import(fresh_python, raw):
    """A size past int64 (or a double's range) is refused like any bad value: the import
    works and the device's first use names the variable."""
    r = fresh_python("import torch\n"
                     "print(torch.ones(2).sum().item(), torch.neuron.is_available())\n"
                     "try:\n    torch.ones(1, device='neuron')\n"
                     "except RuntimeError as e:\n    print('ERR', e)\n",
                     env={"NEURONLOCAL_HBM_PER_CORE": raw})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Failed to load the backend extension" not in r.stderr, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "2.0 False", r.stdout
    assert lines[1].startswith(f"ERR neuron device unavailable: NEURONLOCAL_HBM_PER_CORE={raw!r} "
                               "is not a size"), lines


def test_log_level_above_the_range_is_refused_with_the_range():
    _, _, err = hardware.load({"TORCH_NEURONX_LOG_LEVEL": "99"})
    assert err is not None and f"use 0 (off) to {3} (debug)" in str(err)


def test_text_variables_and_autoload_switch_never_break_import(fresh_python):
    env = {v.name: "weird value \u00e9" for v in ENV_VARS if v.kind == "text"}
    r = fresh_python("import torch; print(torch.ones(2).sum().item(), hasattr(torch, 'neuron'))",
                     env=env)
    assert r.returncode == 0, r.stderr
    # TORCH_DEVICE_BACKEND_AUTOLOAD is PyTorch's: anything but 1 turns the autoload off
    assert r.stdout.split() == ["2.0", "False"]


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "neuronlocal", *args], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)


def test_env_and_info_show_the_error():
    env = {"NEURON_RT_VISIBLE_CORES": "99", "NEURONLOCAL_STRICT": "maybe"}
    r = _cli(["env"], env)
    assert r.returncode == 1
    assert "| `NEURONLOCAL_STRICT` |" in r.stdout  # the table is still printed
    assert "NEURONLOCAL_STRICT=maybe" in r.stdout and "NEURON_RT_VISIBLE_CORES=99" in r.stdout
    assert "NEURONLOCAL_STRICT='maybe' is not a boolean" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli(["info"], env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "neuron device unavailable: NEURONLOCAL_STRICT='maybe'" in r.stderr
    assert "NEURON_RT_VISIBLE_CORES='99' names core(s) [99]" in r.stderr
    r = _cli(["env"], {})
    assert r.returncode == 0


def test_torchrun_cpu_job_runs_with_a_bad_variable(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "t = torch.ones(2)\n"
                      "dist.all_reduce(t)\n"
                      "print('SUM', t.tolist())\n"
                      "dist.destroy_process_group()\n")
    import os

    env = {**os.environ, "NEURON_RT_VISIBLE_CORES": "99", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--standalone", str(script)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SUM [1.0, 1.0]" in r.stdout



@pytest.mark.parametrize("raw, says", [
    ("0-99999999", "names core(s) [99999999]"),
    ("-5-2", "is not a list of cores"),
    ("0," * 20000 + "0", "lists a core twice"),
    ("1" * 5000, "is not a list of cores"),
])
def test_visible_cores_are_bounded_before_they_are_expanded(raw, says):
    """A huge range or list is refused from its bounds, in a short message, without
    building a list of every core it names."""
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(hardware.ConfigError) as err:
        hardware.parse_visible(raw, 8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert says in str(err.value) and len(str(err.value)) < 300
    assert peak < 2**20
