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


@pytest.fixture
def isolated_compile(tmp_path, monkeypatch):
    """A private NEFF cache and fresh Dynamo and graph records, for tests that compile."""
    from neuronlocal.compile.static import _CACHE
    from neuronlocal.core import dynamo_metrics as metrics

    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neff"))
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "locks"))
    torch._dynamo.reset()
    metrics.reset_dynamo_metrics()
    _CACHE.memory.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _reset_tracking():
    torch_neuronx = pytest.importorskip("torch_neuronx")
    torch_neuronx.clear_op_tracking()
    yield


# ---- HTML pages in a real browser ---------------------------------------------------------

_CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
# Appended to a copy of the page: measures its layout, then writes the numbers into the DOM
# for --dump-dom. First as shown (details closed), then with every <details> open.
_MEASURE = """<script>
function measure(){const W=document.documentElement.clientWidth,over=[];let tall=0;
for(const el of document.body.querySelectorAll('*')){const r=el.getBoundingClientRect();
if(r.width&&r.right>W+1)over.push(el.tagName+(el.id?'#'+el.id:'')+' '+Math.round(r.right));
if(el.tagName=='TD')tall=Math.max(tall,r.height);}
return {viewport:W,scroll:document.documentElement.scrollWidth,
body:document.body.getBoundingClientRect().width,tallest_cell:tall,over:over.slice(0,20)};}
const shown=measure();document.querySelectorAll('details').forEach(d=>d.open=true);
const opened=measure();const p=document.createElement('pre');p.id='neuronlocal-layout';
p.textContent=JSON.stringify({shown,opened});document.body.appendChild(p);
</script>"""


def chromium() -> str | None:
    import shutil

    return next((p for p in map(shutil.which, _CHROMIUM) if p), None)


def page_layout(page: str, tmp_path, width: int = 1400) -> dict:
    """Layout numbers of an HTML page in headless Chromium at `width` px (skips without it)."""
    import html
    import json
    import re

    exe = chromium()
    if exe is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium); the page "
                    "structure is checked without it")
    path = tmp_path / f"layout-{width}.html"
    path.write_text(page.replace("</body>", _MEASURE + "</body>"))
    profile = tmp_path / f"chromium-{width}"
    out = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", f"--window-size={width},900", "--dump-dom",
         path.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="neuronlocal-layout">(.*?)</pre>', out.stdout, re.S)
    assert m, f"no layout from chromium (exit {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))
