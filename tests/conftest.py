"""Shared test setup: the backend autoloads with `import torch`; tests run on neuron vs CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

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
