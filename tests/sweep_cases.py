"""What the OpInfo and ModuleInfo sweeps share: pytest parameters and the verdict of a case.

Each sweep module (neuronlocal.support.opinfo_sweep, module_sweep) yields (entry, dtype)
cases and runs one into a result with a status; these turn them into pytest terms the same
way for both, so an expected failure, a CPU failure and a neuron-only failure read alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest


def params(cases: Iterable[tuple[Any, str]], name_of: Callable[[Any], str],
           known_failures: dict[str, str]) -> list:
    """One pytest.param per case, id `<name>-<dtype>`, xfail (with its reason) when known."""
    out = []
    for entry, dtype in cases:
        name = name_of(entry)
        marks = []
        if name in known_failures:
            marks.append(pytest.mark.xfail(reason=known_failures[name], strict=False))
        out.append(pytest.param(entry, dtype, id=f"{name}-{dtype}", marks=marks))
    return out


def verdict(r: Any) -> None:
    """Skips what cannot be judged (with why), fails a neuron-only failure, else checks
    that something ran."""
    if r.status == "skip":
        pytest.skip(r.detail)
    if r.status == "cpu-fail":
        pytest.skip(f"fails on CPU too: {r.detail}")
    if r.status == "fail":
        pytest.fail(f"{r.id}: neuron-only failure: {r.detail}", pytrace=False)
    assert r.samples > 0


def require_full_sweep(request: pytest.FixtureRequest, what: str) -> None:
    """The full sweeps run only when selected: `-m slow` or NEURONLOCAL_OPINFO_FULL=1."""
    markexpr = request.config.getoption("markexpr", "") or ""
    if "slow" not in markexpr and os.environ.get("NEURONLOCAL_OPINFO_FULL") != "1":
        pytest.skip(f"full {what} sweep: select it with -m slow or NEURONLOCAL_OPINFO_FULL=1")
