"""PyTorch's OpInfo database on neuron vs CPU (logic: neuronlocal.support.opinfo_sweep).

- `test_opinfo_ci`: a fixed subset (CI_OPS), a few samples per pair, runs by default.
- `test_opinfo_full`: every OpInfo of op_db, all samples; marked slow and run only when
  selected (`pytest -m slow`) or with NEURONLOCAL_OPINFO_FULL=1.
  `tools/op_support.py` runs the same sweep and writes docs/op-support.md.

Both run with the 64-bit downcast policy off (exact int64); `test_downcast_policy_on`
checks the default policy separately.
"""

from __future__ import annotations

import pytest
import torch

import neuronlocal
import sweep_cases
from neuronlocal.support import opinfo_sweep as sweep


def _params(names: tuple[str, ...] | None) -> list:
    return sweep_cases.params(sweep.cases(names), sweep.op_name, sweep.KNOWN_FAILURES)


def _check(op, dtype: str, max_samples: int | None) -> None:
    sweep_cases.verdict(sweep.run_case(op, dtype, max_samples))


@pytest.mark.parametrize(("op", "dtype"), _params(sweep.CI_OPS))
def test_opinfo_ci(op, dtype):
    _check(op, dtype, sweep.CI_MAX_SAMPLES)


@pytest.fixture
def _full_sweep_selected(request):
    sweep_cases.require_full_sweep(request, "OpInfo")


@pytest.mark.slow
@pytest.mark.usefixtures("_full_sweep_selected")
@pytest.mark.parametrize(("op", "dtype"), _params(None))
def test_opinfo_full(op, dtype):
    _check(op, dtype, None)


def test_ci_subset_is_fixed_and_known():
    """CI_OPS names real OpInfos once each and covers what its comment promises: in-place
    and out= variants and a random op. Every entry of the exception tables names a real
    OpInfo (a stale entry fails here) and carries a reason."""
    by_name = sweep.ops_by_name()
    missing = [n for n in sweep.CI_OPS if n not in by_name]
    assert not missing, f"CI_OPS names not in op_db: {missing}"
    assert len(set(sweep.CI_OPS)) == len(sweep.CI_OPS)
    chosen = [by_name[n] for n in sweep.CI_OPS]
    assert any(op.inplace_variant is not None for op in chosen)
    assert any(op.supports_out for op in chosen)
    assert "nn.functional.dropout" in sweep.CI_OPS
    names = set(by_name) | {op.name for op in by_name.values()}
    for table in (sweep.KNOWN_FAILURES, sweep.VALUE_SKIPS, sweep.CPU_ARGS):
        assert table
        stale = [k for k in table if k not in names]
        assert not stale, f"entries naming no OpInfo: {stale}"
        assert all(isinstance(r, str) and r for r in table.values()), "every entry has a reason"


def test_sweep_restores_policy():
    before = neuronlocal.config
    with sweep.sweep_policy():
        assert neuronlocal.config.downcast_64bit is False
    assert neuronlocal.config.downcast_64bit == before.downcast_64bit
    assert neuronlocal.config.strict == before.strict


def test_downcast_policy_on():
    """The sweep runs with the policy off; here the default (on) is exercised: int64 and
    float64 are computed in 32 bits, results come back in the caller's dtype."""
    import torch_neuronx
    from neuronlocal.eager import set_policy

    cfg = neuronlocal.config
    set_policy(downcast_64bit=True)
    try:
        torch_neuronx.clear_op_tracking()
        a = torch.arange(10, dtype=torch.int64)
        b = torch.full((10,), 3, dtype=torch.int64)
        r = a.to("neuron") * b.to("neuron")
        assert r.dtype == torch.int64 and r.device.type == "neuron"
        assert torch.equal(r.cpu(), a * b)
        # int32 arithmetic wraps where int64 would not (what Trainium computes).
        big = torch.tensor([2**31 - 1], dtype=torch.int64)
        assert (big.to("neuron") + 1).item() == -(2**31)
        x = torch.randn(8, dtype=torch.float64)
        y = x.to("neuron").exp()
        assert y.dtype == torch.float64
        torch.testing.assert_close(y.cpu(), x.float().exp().double())
        assert "aten::mul.Tensor" in torch_neuronx.get_downcast_ops()
        assert "aten::exp" in torch_neuronx.get_downcast_ops()
        # Data movement is exact: no downcast for copies.
        huge = torch.tensor([2**40], dtype=torch.int64)
        assert huge.to("neuron").clone().item() == 2**40
        # And the sweep really turns it off.
        with sweep.sweep_policy():
            assert (big.to("neuron") + 1).item() == 2**31
    finally:
        set_policy(downcast_64bit=cfg.downcast_64bit)


def _binary_ufuncs() -> list:
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo

    return [pytest.param(op, id=sweep.op_name(op)) for op in sweep.op_db()
            if isinstance(op, BinaryUfuncInfo)]


@pytest.mark.parametrize("op", _binary_ufuncs())
def test_cpu_scalar_tensor_operand(op):
    """A 0-dim CPU tensor is a scalar operand for a neuron tensor, as on CUDA
    (TensorIterator's rule): the result is on neuron and equals CPU's. As the first operand
    too, except for composites that allocate their result on the first operand's device
    (logical_and, complex, polar): they reject it with the device error, as on CUDA."""
    dtype = torch.float32 if torch.float32 in op.supported_dtypes("cpu") else torch.int64
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(5, generator=g) * 4 + 0.5).to(dtype)
    s = torch.tensor(2, dtype=dtype)
    for first_scalar, args in ((False, (x, s)), (True, (s, x))):
        try:
            want = op(*args)
        except Exception:  # noqa: BLE001  (this side is not supported on CPU either)
            continue
        on_neuron = [a.to("neuron") if a.dim() else a for a in args]
        try:
            got = op(*on_neuron)
        except RuntimeError as e:
            if first_scalar and "Expected all tensors to be on the same device" in str(e):
                continue
            raise
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)


def test_refs_copysign_rejects_a_cpu_divisor_as_on_cuda():
    """torch's Python reference of copysign checks devices itself and raises on CUDA too
    (OpInfo skips it for that reason); neuron gives the same error, with its device name."""
    with pytest.raises(RuntimeError, match=r"Expected divisor \(b\) to be on the same device "
                                           r"\(neuron:0\) as dividend \(a\), but it is found on "
                                           "cpu!"):
        torch._refs.copysign(torch.ones(3, device="neuron"), torch.tensor(-1.0))
    torch.testing.assert_close(torch.copysign(torch.ones(3, device="neuron"),
                                              torch.tensor(-1.0)).cpu(), -torch.ones(3))
