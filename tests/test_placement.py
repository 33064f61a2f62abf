"""Op placement: the generated table, and everything that reads it at run time (op tracking,
the once-per-op fallback warning, strict mode, 64-bit rule, bytes moved, native mode, CLI)."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

import neuronlocal
import torch_neuronx
from neuronlocal import cli
from neuronlocal.eager import ops, set_policy, tracking

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("op_placement", ROOT / "tools/op_placement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def placement_policy():
    cfg = neuronlocal.config
    yield set_policy
    set_policy(strict=cfg.strict, downcast_64bit=cfg.downcast_64bit, placement=cfg.placement)


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w]


# ---- the table ---------------------------------------------------------------------------


def test_table_is_what_the_tool_derives_from_its_evidence():
    """Nobody edits the table by hand: re-deriving it from the evidence it carries, torch's
    registrations and the recorded composite traces gives exactly the committed ops."""
    tool = _tool()
    t = ops.table()
    assert t["torch"] == torch.__version__.split("+")[0]
    again = tool.derive(t["evidence"], tool.registrations(), tool.delegates(),
                        tool.schema_flags(), t["traced"], tool.direct_composites())
    assert again == t["ops"]
    counts = {k: sum(e["placement"] == k for e in again.values()) for k in ops.PLACEMENTS}
    assert t["counts"] == counts


def test_placements_follow_the_evidence():
    t = ops.table()
    for name in t["evidence"]["device_ops"]:
        assert ops.placement(name).placement == "device", name
    assert {p.placement for p in ops.all_placements().values()} == set(ops.PLACEMENTS)
    # explicit CPU-fallback list of the snapshot: all run on the host
    for name in t["evidence"]["cpu_fallback_explicit"]:
        assert ops.placement(name).runs == "host", name
    # registered only by a module that fails to import: a host op
    assert ops.placement("aten::min").placement == "host"
    assert "fails to import" in ops.placement("aten::min").evidence()


@pytest.mark.parametrize(("op", "where", "runs", "host_op"), [
    ("aten::mm", "device", "device", None),
    ("aten::div.Tensor", "composite", "device", None),       # -> div.out, a device kernel
    ("aten::atan2", "composite", "host", "aten::atan2.out"),  # -> atan2.out: no kernel
    ("aten::atan2_", "composite", "host", "aten::atan2.out"),
    ("aten::sort.stable", "composite", "host", "aten::sort.values_stable"),
    ("aten::sort.values_stable", "host", "host", "aten::sort.values_stable"),
    ("aten::linalg_inv_ex", "composite", "host", "aten::linalg_inv_ex"),  # explicit fallback
    ("aten::linalg_lu", "composite", "host", "aten::linalg_lu.out"),
    ("aten::native_group_norm", "composite", "host", "aten::var_mean.correction"),
    ("aten::mode.values", "composite", "host", "aten::mode.values"),
    ("aten::layer_norm", "composite", "device", None),        # never reaches the backend
    ("aten::one_hot", "device", "device", None),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "device", "device", None),
])
def test_placement_of(op, where, runs, host_op):
    p = ops.placement(op)
    assert (p.placement, p.runs, p.host_op) == (where, runs, host_op)
    assert p.evidence()


def test_names_and_unknown_ops():
    assert ops.placement("mm") == ops.placement("aten.mm.default") == ops.placement("aten::mm")
    with pytest.raises(KeyError, match="not an ATen op"):
        ops.placement("aten::no_such_op")
    assert ops.placement("mylib::op").runs == "host"


def test_view_ops_are_quiet_and_float_power_is_float64():
    assert ops.placement("aten::view_as_real").quiet
    assert not ops.placement("aten::atan2.out").quiet
    assert {"aten::float_power.Tensor_Tensor", "aten::float_power_.Scalar"} <= ops.float64_ops()


# ---- at run time -------------------------------------------------------------------------


def test_structured_fallback_is_named_by_its_out_op_warned_once_with_bytes():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    an, bn = a.to("neuron"), b.to("neuron")
    tracking.clear_op_tracking()
    _caught(lambda: (torch.atan2(an, bn), torch.atan2(an, bn), an.clone().atan2_(bn)))
    torch.testing.assert_close(torch.atan2(an, bn).cpu(), torch.atan2(a, b))
    fb = torch_neuronx.get_fallback_ops()
    assert fb == {"aten::atan2.out": 4}
    assert "aten::atan2" in torch_neuronx.get_executed_ops()
    traffic = tracking.get_fallback_traffic()["aten::atan2.out"]
    # per call: both 64-byte inputs to the host, the 64-byte result (or written self) back
    assert traffic == {"calls": 4, "to_host": 4 * 128, "from_host": 4 * 64}


ONCE_SCRIPT = """
import json, warnings, torch
a = torch.randn(4, 4).to("neuron")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.atan2(a, a); a.clone().atan2_(a); torch.atan2(a, a, out=torch.empty(0, device="neuron"))
    torch.view_as_real(torch.randn(3, dtype=torch.complex64).to("neuron"))
    torch.mm(a, a)
import torch_neuronx
print(json.dumps([[str(w.message) for w in caught], torch_neuronx.get_fallback_ops()]))
"""


def test_one_warning_per_fallback_op_and_none_for_views(fresh_python):
    r = fresh_python(ONCE_SCRIPT)
    assert r.returncode == 0, r.stderr
    messages, fallbacks = json.loads(r.stdout.splitlines()[-1])
    fb = [m for m in messages if "executed via CPU fallback" in m]
    assert len(fb) == 1, messages
    assert fb[0].startswith("aten::atan2.out executed via CPU fallback (reached from aten::atan2)")
    assert fallbacks == {"aten::atan2.out": 3, "aten::view_as_real": 1}


def test_fallback_warning_points_at_the_calling_line_not_a_cpp_source(tmp_path, fresh_python):
    script = tmp_path / "prog.py"
    script.write_text("import warnings, torch\n"
                      "x = torch.randn(3).to('neuron')\n"
                      "with warnings.catch_warnings(record=True) as caught:\n"
                      "    warnings.simplefilter('always')\n"
                      "    torch.atan2(x, x)\n"
                      "w, = [w for w in caught if 'CPU fallback' in str(w.message)]\n"
                      "print(w.filename, w.lineno, str(w.message))\n")
    r = fresh_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert r.returncode == 0, r.stderr
    filename, line, message = r.stdout.strip().split(" ", 2)
    assert (filename, line) == (str(script), "5")
    assert "Triggered internally" not in message and ".cpp" not in message


BACKWARD_SCRIPT = """\
import sys, threading, warnings, torch
x = torch.randn(2, 3, 4, 4).to('neuron').requires_grad_(True)
loss = torch.nn.functional.avg_pool2d(x, 2).sum()
def run():
    loss.backward()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    if sys.argv[1] == 'thread':
        t = threading.Thread(target=run); t.start(); t.join()
    else:
        loss.backward()
w, = [w for w in caught if 'avg_pool2d_backward' in str(w.message)]
print(w.filename, w.lineno, str(w.message))
"""


@pytest.mark.parametrize(("where", "line"), [("main", "11"), ("thread", "5")])
def test_fallback_warning_in_backward_points_at_the_backward_line(tmp_path, fresh_python,
                                                                  where, line):
    """avg_pool2d's backward has no device kernel: it falls back on autograd's device thread,
    and its warning names the program's line that ran the backward (in its own thread)."""
    script = tmp_path / "prog.py"
    script.write_text(BACKWARD_SCRIPT)
    r = fresh_python(f"import runpy, sys; sys.argv = ['prog', {where!r}]; "
                     f"runpy.run_path({str(script)!r}, run_name='__main__')")
    assert r.returncode == 0, r.stderr
    filename, lineno, message = r.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (filename, lineno) == (str(script), line)
    assert message.startswith("aten::avg_pool2d_backward.grad_input executed via CPU fallback")
    assert "Triggered internally" not in message and ".cpp" not in message


def test_ops_torchneuron_registers_are_tracked_by_their_own_name():
    """isfinite, index_select_backward and value_selecting_reduction_backward (composites in
    torch) and histc (a Python kernel here) are device kernels on TorchNeuron: tracked as
    executed under their own names, with results and gradients as on CPU; a compile's
    tracing records nothing."""
    x = torch.tensor([1.0, float("inf"), float("nan")])
    tracking.clear_op_tracking()
    assert torch.isfinite(x.to("neuron")).cpu().tolist() == [True, False, False]
    torch.histc(x[:1].to("neuron"), bins=4)
    w = torch.randn(5, 3)
    wn = w.to("neuron").requires_grad_(True)
    torch.index_select(wn, 0, torch.tensor([0, 2, 2], device="neuron")).sum().backward()
    v = torch.randn(4, 5)
    vn = v.to("neuron").requires_grad_(True)
    torch.max(vn, dim=1).values.sum().backward()
    ran = torch_neuronx.get_executed_ops()
    for op in ("aten::isfinite", "aten::histc", "aten::index_select_backward",
               "aten::value_selecting_reduction_backward"):
        assert ran.get(op) == 1, (op, ran)
    wc, vc = w.clone().requires_grad_(True), v.clone().requires_grad_(True)
    torch.index_select(wc, 0, torch.tensor([0, 2, 2])).sum().backward()
    torch.max(vc, dim=1).values.sum().backward()
    torch.testing.assert_close(wn.grad.cpu(), wc.grad)
    torch.testing.assert_close(vn.grad.cpu(), vc.grad)
    f = torch.compile(lambda a: torch.isfinite(a).sum(), backend="neuron")
    assert f(x.to("neuron")).item() == 1
    assert torch_neuronx.get_executed_ops()["aten::isfinite"] == 1


def test_every_composite_torchneuron_registers_is_tracked_by_name():
    """The placement table decides, not a list: every CompositeImplicitAutograd op placed on
    the device has a neuron kernel, so `linear`, `_fused_rms_norm` (which TorchNeuron's
    rms_norm runs; its gradients from `_fused_rms_norm_backward`, as there), `silu_backward`
    and the SyncBatchNorm helpers are tracked under their own names, in inference mode too,
    with CPU's results and gradients."""
    from neuronlocal.eager import ops

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    missing = [n for n, e in ops.table()["ops"].items()
               if e["placement"] == "device" and has(n, "CompositeImplicitAutograd")
               and not has(n, "PrivateUse1") and not has(n, "AutogradPrivateUse1")]
    assert missing == []
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 8), torch.randn(3, 8), torch.randn(8)
    xn, wn, gn = (t.to("neuron").requires_grad_(True) for t in (x, w, g))
    xc, wc, gc = (t.clone().requires_grad_(True) for t in (x, w, g))
    tracking.clear_op_tracking()
    outs = [torch.nn.functional.linear(xn, wn), torch.nn.functional.rms_norm(xn, (8,), gn),
            torch.nn.functional.silu(xn)]
    sum(o.sum() for o in outs).backward()
    with torch.inference_mode():
        torch.nn.functional.linear(xn.detach(), wn.detach())
        torch.batch_norm_stats(xn.detach(), 1e-5)
    ran = torch_neuronx.get_executed_ops()
    for op, calls in (("aten::linear", 2), ("aten::rms_norm", 1), ("aten::_fused_rms_norm", 1),
                      ("aten::_fused_rms_norm_backward", 1), ("aten::silu_backward", 1),
                      ("aten::batch_norm_stats", 1)):
        assert ran.get(op) == calls, (op, ran)
    want = [torch.nn.functional.linear(xc, wc), torch.nn.functional.rms_norm(xc, (8,), gc),
            torch.nn.functional.silu(xc)]
    sum(o.sum() for o in want).backward()
    for got, ref in zip([*outs, xn.grad, wn.grad, gn.grad], [*want, xc.grad, wc.grad, gc.grad],
                        strict=True):
        torch.testing.assert_close(got.detach().cpu(), ref.detach())
    half = torch.nn.functional.rms_norm(xn.detach().bfloat16(), (8,), gn.detach())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.cpu(), torch.nn.functional.rms_norm(x, (8,), g).bfloat16())


def test_strict_names_the_op_that_falls_back(placement_policy):
    a = torch.randn(3).to("neuron")
    placement_policy(strict=True)
    with pytest.raises(RuntimeError, match=r"^aten::atan2\.out \(reached from aten::atan2\) "
                                           r"has no Trainium kernel.*NEURONLOCAL_STRICT=1"):
        torch.atan2(a, a)
    torch.div(a, a + 2)  # a structured op whose .out op has a device kernel: fine


def test_host_ops_compute_in_64_bits(placement_policy):
    """TorchNeuron's CPU fallback runs an op on CPU as it is: no 64-bit downcast there,
    while device ops compute float64 as float32."""
    placement_policy(downcast_64bit=True)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5, 5, dtype=torch.float64, generator=g)
    spd = m @ m.T + 5 * torch.eye(5, dtype=torch.float64)
    tracking.clear_op_tracking()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.linalg.inv(spd.to("neuron")).cpu()
        prod = (spd.to("neuron") * 3).cpu()
    torch.testing.assert_close(got, torch.linalg.inv(spd), rtol=1e-12, atol=1e-12)
    downcast = tracking.get_downcast_ops()
    assert "aten::linalg_inv_ex" not in downcast and "aten::mul.Tensor" in downcast
    torch.testing.assert_close(prod, (spd.float() * 3).double())


def test_native_placement_records_no_fallbacks(placement_policy):
    a = torch.randn(3).to("neuron")
    placement_policy(placement="native")
    tracking.clear_op_tracking()
    assert _caught(lambda: torch.sort(a)) == []
    assert torch_neuronx.get_fallback_ops() == {}
    assert "aten::sort.stable" in torch_neuronx.get_executed_ops()
    placement_policy(placement="trainium")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.sort(a)
    assert torch_neuronx.get_fallback_ops() == {"aten::sort.values_stable": 1}
    with pytest.raises(ValueError, match="placement='cuda'"):
        placement_policy(placement="cuda")


NATIVE_SCRIPT = """
import json, warnings, torch, torch_neuronx
warnings.simplefilter("error")
torch.linalg.qr(torch.randn(3, 3, device="neuron"))
print(json.dumps(torch_neuronx.get_fallback_ops()))
"""


def test_native_placement_env(fresh_python):
    r = fresh_python(NATIVE_SCRIPT, env={"NEURONLOCAL_OP_PLACEMENT": "native"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {}
    bad = fresh_python("import torch; torch.ones(1, device='neuron')",
                       env={"NEURONLOCAL_OP_PLACEMENT": "gpu"})
    assert "NEURONLOCAL_OP_PLACEMENT='gpu' is not supported; use trainium or native" in bad.stderr


def test_device_composites_stay_one_device_op():
    """TorchNeuron registers one_hot and argsort(stable=True) although torch decomposes
    them (into ops that would fall back): they are one device op here too."""
    ids = torch.tensor([0, 3, 1, 3])
    x = torch.randn(6)
    tracking.clear_op_tracking()
    hot = torch.nn.functional.one_hot(ids.to("neuron"), 4)
    order = torch.argsort(x.to("neuron"), stable=True)
    assert torch.equal(hot.cpu(), torch.nn.functional.one_hot(ids, 4))
    assert torch.equal(order.cpu(), torch.argsort(x, stable=True))
    assert torch_neuronx.get_fallback_ops() == {}
    ran = torch_neuronx.get_executed_ops()
    assert "aten::one_hot" in ran and "aten::argsort.stable" in ran


def test_other_namespaces_without_a_neuron_kernel_fall_back():
    lib = torch.library.Library("placement_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    tracking.clear_op_tracking()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.ops.placement_test.twice(torch.ones(2, device="neuron"))
    assert out.device.type == "neuron" and out.cpu().tolist() == [2.0, 2.0]
    assert torch_neuronx.get_fallback_ops() == {"placement_test::twice": 1}


def test_float_power_warns_that_the_64_bit_rule_changes_it(placement_policy):
    from neuronlocal.eager import overrides

    x = torch.tensor([1.1, 2.3, 3.7], requires_grad=True)
    ref = torch.float_power(x, 2.5)
    ref.sum().backward()
    for downcast in (True, False):
        placement_policy(downcast_64bit=downcast)
        overrides._warned.clear()  # once per op and process: start afresh
        xn = x.detach().to("neuron").requires_grad_(True)
        msgs = _caught(lambda xn=xn: (torch.float_power(xn, 2.5), torch.float_power(xn, 2.5)))
        y = torch.float_power(xn, 2.5)
        y.sum().backward()
        assert y.dtype == torch.float64 and y.device.type == "neuron"
        diff = (y.detach().cpu() - ref.detach()).abs().max().item()
        torch.testing.assert_close(xn.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
        if downcast:
            assert msgs == ["aten::float_power.Tensor_Scalar computes in float64 by definition, "
                            "and Trainium computes float64 as float32 (the 64-bit rule), so its "
                            "results differ from CPU's beyond float32 precision. "
                            "NEURONLOCAL_DOWNCAST_64BIT=0 keeps 64 bits."]
            assert 0 < diff < 1e-5
        else:
            assert msgs == [] and diff == 0.0


# ---- neuronlocal ops ---------------------------------------------------------------------


def test_cli_ops(capsys):
    assert cli.main(["ops", "aten::min", "aten::mm", "atan2"]) == 0
    out = capsys.readouterr().out
    assert "aten::min: host\n" in out and "aten::mm: device\n" in out
    assert "aten::atan2: composite; runs on the host as aten::atan2.out" in out
    assert cli.main(["ops", "aten::nope"]) == 2
    assert cli.main(["ops"]) == 0
    summary = capsys.readouterr().out
    assert "device" in summary and "NEURONLOCAL_OP_PLACEMENT=native" in summary
    assert cli.main(["ops", "--list", "host"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "aten::atan2  (runs aten::atan2.out)" in listed and "aten::min" in listed


def test_cli_ops_lists_kernel_ops_as_device_ops(capsys):
    assert cli.main(["ops", "neuronlocal::rms_norm"]) == 0
    assert "neuronlocal::rms_norm: device\n" in capsys.readouterr().out
    assert cli.main(["ops"]) == 0
    assert "NKI kernels" in capsys.readouterr().out
    assert cli.main(["ops", "--list", "device"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "neuronlocal::silu_and_mul" in listed and "aten::mm" in listed
    assert cli.main(["ops", "--list", "host"]) == 0
    assert not any(n.startswith("neuronlocal::") for n in capsys.readouterr().out.splitlines())
