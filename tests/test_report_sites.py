"""The run report's call site of each CPU fallback (report/sites.py): the program's line in
eager code, inside compiled graphs (forward and backward: the FX node's stack trace) and in
a checkpointed region's recompute, views that are never warned included; an op seen only
in eager backward gets the line that called backward."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from neuronlocal.report import collect

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("isolated_compile")]

# RoPE as torchtitan's llama3 computes it: complex numbers, whose views (view_as_complex,
# view_as_real) have no Trainium kernel and are not warned (view ops).
ROPE = """\
import torch


def rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # COMPLEX-LINE
    return torch.view_as_real(xc * freqs).flatten(2)  # REAL-LINE
"""


@pytest.fixture
def rope(tmp_path, monkeypatch):
    path = tmp_path / "rope_model.py"
    path.write_text(textwrap.dedent(ROPE))
    spec = importlib.util.spec_from_file_location("rope_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rope_model", module)  # Dynamo imports it by name
    spec.loader.exec_module(module)
    return module


def _line(marker: str) -> int:
    return ROPE.splitlines().index(next(ln for ln in ROPE.splitlines() if marker in ln)) + 1


def _inputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to("neuron")
    freqs = torch.polar(torch.ones(8, 8), torch.randn(8, 8)).to("neuron")
    return lin, freqs, torch.randn(8, 8, 16, device="neuron")


def _sites(c: collect.Collector) -> dict[str, tuple[str, int]]:
    return {op: (Path(s["file"]).name, s["line"]) for op, s in c.state.fallback_sites.items()}


def _expect_rope_sites(c: collect.Collector, complex_at: str = "COMPLEX-LINE",
                       real_at: str | None = "REAL-LINE") -> dict[str, tuple[str, int]]:
    sites = _sites(c)
    assert sites.get("aten::view_as_complex") == ("rope_model.py", _line(complex_at)), sites
    if real_at is not None:
        assert sites.get("aten::view_as_real") == ("rope_model.py", _line(real_at)), sites
    report = {f["op"]: f for f in collect._fallbacks(c.state.fallback_sites)}
    assert complex_at in report["aten::view_as_complex"]["source"]
    return sites


@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_fallback_site_in_forward(rope, where):
    lin, freqs, x = _inputs()
    fn = (lambda x: rope.rope(lin(x), freqs))
    fn = torch.compile(fn, backend="neuron") if where == "compiled" else fn
    c = collect.Collector().start()
    try:
        fn(x).sum().backward()
    finally:
        c.stop()
    _expect_rope_sites(c)


def test_fallback_site_in_a_compiled_backward(rope):
    """Ops first run in a compiled backward: the line of the forward node each backward
    node comes from (view_as_complex is view_as_real's backward, and the reverse)."""
    lin, freqs, x = _inputs()
    loss = torch.compile(lambda x: rope.rope(lin(x), freqs), backend="neuron")(x).square().sum()
    c = collect.Collector().start()  # the forward's fallbacks were before: not seen
    try:
        loss.backward()
    finally:
        c.stop()
    _expect_rope_sites(c, complex_at="REAL-LINE", real_at="COMPLEX-LINE")


def test_fallback_site_in_a_checkpoint_recompute(rope):
    """view_as_complex runs first as the eager backward of view_as_real (on autograd's side,
    no line of its own: the line calling backward, kept for now), then in the checkpoint's
    recompute, whose line it gets. view_as_real is never recomputed (the recompute stops at
    the last saved tensor): its site stays the backward call's."""
    lin, freqs, x = _inputs()
    out = torch.utils.checkpoint.checkpoint(lambda x: rope.rope(lin(x), freqs), x,
                                            use_reentrant=False)
    loss = out.square().sum()
    c = collect.Collector().start()
    try:
        loss.backward()  # BACKWARD-LINE
    finally:
        c.stop()
    sites = _expect_rope_sites(c, real_at=None)
    here = Path(__file__).read_text().splitlines()
    assert sites["aten::view_as_real"] == (
        Path(__file__).name, next(i for i, ln in enumerate(here, 1) if "# BACKWARD-LINE" in ln))
