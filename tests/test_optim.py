"""Optimizers on `neuron` against plain CPU PyTorch, and the foreach runs behind them.

AdamW, Adam and SGD in every implementation (`foreach=False`, `foreach=True`, `fused=True`
and the default, which is foreach on neuron as on any accelerator) must give CPU's numbers:
bitwise for the same implementation, within float tolerance for the default (CPU's
default is the per-parameter loop). Elementwise foreach ops are queued and run fused per
tensor (csrc/foreach.cpp); the rest of this file checks that nothing can observe the
queue: reads, writes through other paths, memory numbers, aliasing, op tracking.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torch_neuronx
from neuronlocal import _C

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                              "weight_decay": 0.01}),
}
MODES = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
         "default": {}}


def _params(device: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (8, 4, 3), (1,), (256, 16)]
    return [torch.randn(s, generator=g, dtype=dtype).to(device).requires_grad_() for s in shapes]


def _run(device: str, name: str, mode: dict, steps: int = 4,
         dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cls, kw = OPTIMIZERS[name]
    params = _params(device, dtype)
    # two groups, so one step is two runs of foreach ops with different lengths
    opt = cls([{"params": params[:3]}, {"params": params[3:], "lr": kw["lr"] / 2}],
              **kw, **mode)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype).to(device)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for p in params for t in opt.state[p].values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return [p.detach().cpu() for p in params], [t.cpu() for t in state]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_cpu(name, mode):
    params, state = _run("neuron", name, MODES[mode])
    if mode == "default":  # neuron picks foreach (an accelerator), CPU the per-parameter loop
        ref_params, ref_state = _run("cpu", name, {"foreach": False})
        tol = {"rtol": 1e-5, "atol": 1e-6}
    else:
        ref_params, ref_state = _run("cpu", name, MODES[mode])
        tol = {"rtol": 0, "atol": 0}
    assert len(state) == len(ref_state) > 0
    for got, ref in zip(params + state, ref_params + ref_state, strict=True):
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_bfloat16_adamw_matches_cpu(mode):
    params, state = _run("neuron", "adamw", MODES[mode], dtype=torch.bfloat16)
    ref_params, ref_state = _run("cpu", "adamw", MODES[mode], dtype=torch.bfloat16)
    for got, ref in zip(params + state, ref_params + ref_state, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_default_optimizer_is_foreach_and_tracked():
    params = _params("neuron")
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(params).step()
    ops = torch_neuronx.get_executed_ops()
    for op in ("aten::_foreach_lerp_.Scalar", "aten::_foreach_addcmul_.Scalar",
               "aten::_foreach_sqrt", "aten::_foreach_addcdiv_.ScalarList"):
        assert ops.get(op) == 1, (op, ops)


def _lists(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, 7, generator=g).to(device) for _ in range(3)]
    ys = [torch.randn(5, 7, generator=g).to(device) for _ in range(3)]
    return xs, ys


def test_queued_run_matches_cpu_op_by_op():
    """A run mixing in-place, out-of-place and scalar-list ops, read back at the end."""
    results = {}
    for device in ("cpu", "neuron"):
        xs, ys = _lists(device)
        with torch.no_grad():
            torch._foreach_mul_(xs, 0.5)
            torch._foreach_addcmul_(xs, ys, ys, value=0.25)
            s = torch._foreach_sqrt(torch._foreach_abs(xs))
            torch._foreach_div_(s, [1.0, 2.0, 4.0])
            torch._foreach_lerp_(ys, s, 0.3)
            torch._foreach_maximum_(xs, ys)
        results[device] = [t.cpu() for t in [*xs, *ys, *s]]
    for got, ref in zip(results["neuron"], results["cpu"], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_every_read_path_sees_queued_results():
    reads = {
        "item": lambda t: torch.tensor(t[0, 0].item()),
        "cpu": lambda t: t.cpu(),
        "op": lambda t: (t * 1).cpu(),
        "to core 1": lambda t: t.to("neuron:1").cpu(),
        "alias": lambda t: _C._cpu_alias(t).clone(),  # compiled graphs, collectives, kernels
        "repr": lambda t: torch.tensor(float(repr(t).split("[[")[1].split(",")[0])),
    }
    for name, read in reads.items():
        with torch.no_grad():
            x = torch.ones(4, 4, device="neuron")
            torch._foreach_add_([x], 2.0)
            got = read(x)
        assert float(got.flatten()[0]) == 3.0, name


def test_results_of_out_of_place_ops_are_real_tensors():
    xs, _ = _lists("neuron")
    with torch.no_grad():
        out = torch._foreach_exp(xs)
    assert all(o.device == x.device and o.shape == x.shape for o, x in zip(out, xs, strict=True))
    assert len({o.data_ptr() for o in out}) == len(out) and all(o.data_ptr() for o in out)
    torch.testing.assert_close(out[1].cpu(), xs[1].cpu().exp(), rtol=0, atol=0)


def test_lists_sharing_tensors_across_indices_run_in_order():
    """A tensor at index 0 of one op and index 1 of the next cannot be reordered."""
    results = {}
    for device in ("cpu", "neuron"):
        base = torch.arange(12.0).to(device)
        a, c = base[0:6], base[6:12]
        with torch.no_grad():
            torch._foreach_mul_([a, c], 2.0)
            torch._foreach_add_([c, a], [a, c])  # index 0 writes c from a, index 1 a from c
            torch._foreach_mul_([a, c], [3.0, 0.5])
        results[device] = base.cpu()
    torch.testing.assert_close(results["neuron"], results["cpu"], rtol=0, atol=0)


def test_data_assignment_after_queueing_keeps_the_old_bytes():
    with torch.no_grad():
        p = torch.nn.Parameter(torch.ones(3, device="neuron"))
        old = p.detach()
        torch._foreach_mul_([p], 5.0)
        p.data = torch.zeros(3, device="neuron")
        assert old.cpu().tolist() == [5.0, 5.0, 5.0]
        assert p.cpu().tolist() == [0.0, 0.0, 0.0]


def test_grad_mode_and_unqueueable_arguments_run_at_once():
    x = torch.ones(3, device="neuron", requires_grad=True)
    y = torch._foreach_mul([x], 2.0)[0]
    y.sum().backward()
    assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    with torch.no_grad():
        ints = [torch.arange(4, device="neuron")]
        torch._foreach_add_(ints, 1)  # integer: not queued
        d = [torch.ones(2, 3, device="neuron").t()]  # transposed: still dense, queued
        torch._foreach_mul_(d, torch.tensor(3.0, device="neuron"))  # lone Tensor: at once
    assert ints[0].cpu().tolist() == [1, 2, 3, 4]
    assert d[0].cpu().tolist() == [[3.0, 3.0]] * 3


def test_memory_numbers_are_those_of_ops_run_one_by_one():
    gc.collect()
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    with torch.no_grad():
        xs = [torch.ones(1024, device="neuron") for _ in range(4)]
        tmp = torch._foreach_sqrt(xs)  # allocated when called, as an eager op would
        torch._foreach_add_(tmp, 1.0)
        assert torch.neuron.memory_allocated() - base == 8 * 4096
        torch._foreach_mul_(xs, tmp)
        del tmp  # the queued mul_ still reads tmp: freed once it ran, seen by the query
        assert torch.neuron.memory_allocated() - base == 4 * 4096
    assert xs[0].cpu().tolist()[:2] == [2.0, 2.0]
    del xs
    gc.collect()
    assert torch.neuron.memory_allocated() == base


def test_events_time_queued_work():
    xs = [torch.ones(256, 256, device="neuron") for _ in range(8)]
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    with torch.no_grad():
        for _ in range(20):
            torch._foreach_mul_(xs, 1.0001)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 0
    torch.testing.assert_close(xs[0].cpu(), torch.full((256, 256), 1.0001 ** 20))


def _foreach_overloads() -> list[str]:
    names = []
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::_foreach_"):
            continue
        name, _, overload = full[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        if torch.Tag.out not in op.tags:
            names.append(full)
    return sorted(names)


def _call_args(schema: torch._C.FunctionSchema, device: str) -> list | None:
    g = torch.Generator().manual_seed(3)
    args = []
    for a in schema.arguments:
        t = str(a.type)
        if t == "List[Tensor]":
            args.append([(torch.rand(4, 5, generator=g) + 0.5).to(device) for _ in range(3)])
        elif t == "List[number]":  # Scalar[]
            args.append([0.5, 1.5, 2.0])
        elif t == "number":
            args.append(0.75)
        elif t == "bool":
            args.append(False)
        elif a.has_default_value():
            break
        else:
            return None  # lone tensors, dtypes, ...: not the elementwise family
    return args


def test_every_foreach_op_matches_cpu():
    """Each foreach overload (queued or not) on float lists gives CPU's numbers bitwise."""
    checked = 0
    for full in _foreach_overloads():
        name, _, overload = full[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        outs = {}
        for device in ("cpu", "neuron"):
            args = _call_args(op._schema, device)
            if args is None:
                break
            with torch.no_grad():
                try:
                    res = op(*args)
                except RuntimeError as e:  # rejected on CPU too (checked below)
                    outs[device] = type(e)
                    continue
            lists = [a for a in args if isinstance(a, list) and isinstance(a[0], torch.Tensor)]
            outs[device] = [t.cpu() for t in (list(res or []) + [x for lst in lists for x in lst])]
        if len(outs) < 2:
            continue
        if outs["cpu"] is RuntimeError or outs["neuron"] is RuntimeError:
            assert outs["cpu"] is outs["neuron"], full
            continue
        for got, ref in zip(outs["neuron"], outs["cpu"], strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=full)
        checked += 1
    assert checked > 100  # the elementwise family: about 180 overloads in torch 2.13


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("inplace", [False, True])
def test_scalar_list_of_another_length_is_a_value_error(name, inplace):
    """TorchNeuron's add/sub/mul/div kernels with a scalar list refuse one whose length is
    not the tensor list's with a ValueError (CPU's check raises RuntimeError with the same
    words); nothing is changed, and lists of one length still give CPU's results."""
    op = getattr(torch, f"_foreach_{name}{'_' if inplace else ''}")
    xs = [torch.full((3,), 2.0, device="neuron") for _ in range(3)]
    with pytest.raises(ValueError, match="same number of elements as scalar list.*3 tensors and 2"):
        op(xs, [1.0, 2.0])
    for x in xs:
        torch.testing.assert_close(x.cpu(), torch.full((3,), 2.0))
    got = {}
    for device in ("cpu", "neuron"):
        ts = [torch.full((3,), 2.0, device=device) for _ in range(3)]
        out = op(ts, [1.0, 2.0, 4.0])
        got[device] = [t.cpu() for t in (ts if inplace else out)]
    for g, want in zip(got["neuron"], got["cpu"], strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
