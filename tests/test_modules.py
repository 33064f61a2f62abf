"""PyTorch's ModuleInfo database on neuron vs CPU (logic: neuronlocal.support.module_sweep).

- `test_module_ci`: a fixed subset (CI_MODULES), a few inputs per pair, runs by default.
- `test_module_full`: every ModuleInfo of module_db, all inputs; marked slow and run only
  when selected (`pytest -m slow`) or with NEURONLOCAL_OPINFO_FULL=1.
  `tools/op_support.py --sweep modules` runs the same sweep and publishes it in
  docs/op-support.md.
"""

from __future__ import annotations

import pytest
import torch

import sweep_cases
from neuronlocal.support import module_sweep as sweep


def _params(names: tuple[str, ...] | None) -> list:
    return sweep_cases.params(sweep.cases(names), lambda info: info.name, sweep.KNOWN_FAILURES)


def _check(info, dtype: str, max_inputs: int | None) -> None:
    sweep_cases.verdict(sweep.run_case(info, dtype, max_inputs))


@pytest.mark.parametrize(("info", "dtype"), _params(sweep.CI_MODULES))
def test_module_ci(info, dtype):
    _check(info, dtype, sweep.CI_MAX_INPUTS)


@pytest.fixture
def _full_sweep_selected(request):
    sweep_cases.require_full_sweep(request, "ModuleInfo")


@pytest.mark.slow
@pytest.mark.usefixtures("_full_sweep_selected")
@pytest.mark.parametrize(("info", "dtype"), _params(None))
def test_module_full(info, dtype):
    _check(info, dtype, None)


def test_ci_subset_is_fixed_and_known():
    by_name = sweep.modules_by_name()
    missing = [n for n in sweep.CI_MODULES if n not in by_name]
    assert not missing, f"CI_MODULES names not in module_db: {missing}"
    assert len(set(sweep.CI_MODULES)) == len(sweep.CI_MODULES)
    stale = [k for k in sweep.KNOWN_FAILURES if k not in by_name]
    assert not stale, f"KNOWN_FAILURES entries naming no ModuleInfo: {stale}"
    assert all(isinstance(r, str) and r for r in sweep.KNOWN_FAILURES.values())


def test_a_wrong_neuron_result_fails():
    """The comparison can fail: a module whose neuron forward differs from CPU's."""

    class Off(torch.nn.Linear):
        def forward(self, input):
            out = super().forward(input)
            return out + 1 if out.device.type == "neuron" else out

    info = sweep.modules_by_name()["nn.Linear"]
    fake = type(info)(Off, module_inputs_func=info.module_inputs_func)
    r = sweep.run_case(fake, "float32", 1)
    assert r.status == "fail" and "output[0]" in r.detail


def test_a_16_bit_mismatch_is_judged_against_float64():
    """In bfloat16, neuron may differ from CPU where ATen takes another path on devices (the
    fused RNN cells): it passes only if it is no further from a float64 run than CPU."""
    c = {"x": torch.tensor([1.0, 2.0])}
    ref = {"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    sweep._no_worse_than_cpu({"x": torch.tensor([1.0, 2.02])}, c, ref, torch.bfloat16, "s")
    with pytest.raises(AssertionError, match="neuron is 0.5 from the float64 run, CPU 0"):
        sweep._no_worse_than_cpu({"x": torch.tensor([1.0, 2.5])}, c, ref, torch.bfloat16, "s")
