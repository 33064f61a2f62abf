"""Shared test setup: the backend autoloads with `import torch`; tests run on neuron vs CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The suite runs under the default profile and policies, whatever the user's shell sets:
# every neuronlocal, TorchNeuron and Neuron runtime variable (instance, LNC, visible cores,
# HBM per core, policies, cache) and torchrun's rank variables are removed before
# `import torch` autoloads the backend, so subprocesses inherit the same clean environment.
# NEURONLOCAL_OPINFO_FULL is a switch of this suite, not of the backend.
_TEST_SWITCHES = {"NEURONLOCAL_OPINFO_FULL"}
for _name in list(os.environ):
    if (_name.startswith(("NEURON", "TORCH_NEURONX_")) and _name not in _TEST_SWITCHES
            or _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        del os.environ[_name]

import torch  # noqa: E402  (after the environment is pinned)

assert hasattr(torch, "neuron"), "neuronlocal did not autoload: is it installed (pip install -e .)?"


def run_python(
    code: str, env: dict[str, str] | None = None, timeout: int = 120
) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for env-var and import-time behaviour)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fresh_python():
    return run_python


@pytest.fixture(autouse=True)
def _reset_tracking():
    torch_neuronx = pytest.importorskip("torch_neuronx")
    torch_neuronx.clear_op_tracking()
    yield
