"""PyTorch's ModuleInfo database run on neuron vs CPU: the module conformance sweep.

For each ModuleInfo in `module_db` and each dtype of `DTYPES`, the module inputs are
generated once on CPU (seeded). For every input, in training mode and, where the ModuleInfo
says training and evaluation differ, in eval mode too, the same module (built on CPU,
seeded, lazy parameters materialized by one CPU forward, converted to the dtype) runs on CPU
and on neuron:

- forward; outputs, and buffers afterwards (BatchNorm's running statistics), are compared
  with `torch.testing.assert_close`;
- backward of a weighted sum of the float outputs (weights drawn once on CPU): gradients of
  every parameter and of every input that requires grad are compared.

In 16-bit dtypes a mismatch is not yet a failure: where ATen takes another path on a
non-CPU device (the fused RNN cells), both sides round differently. The sample then also
runs on CPU in float64 (same values), and neuron fails only if it is further from that than
CPU is (twice CPU's error plus the dtype's tolerance).

Same rules as the OpInfo sweep (`opinfo_sweep`): a pair passes on CPU if at least one input
runs on CPU, inputs that raise on CPU are not run on neuron, modules that draw random
numbers are compared by shapes and dtypes only, the 64-bit downcast is off.

Used by tests/test_modules.py (`CI_MODULES` by default, all of module_db with -m slow) and
by tools/op_support.py, which publishes the pass rate in docs/op-support.md.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from neuronlocal.support import opinfo_sweep as ops_sweep
from neuronlocal.support.opinfo_sweep import DEVICE, Result

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOW_PRECISION = (torch.bfloat16, torch.float16)

# Known neuron-only failures, each with its reason (tests mark them xfail).
KNOWN_FAILURES: dict[str, str] = {}

# The fixed subset CI runs by default: the layers transformer and vision models are built
# from, recurrent layers, losses, and modules that keep state in buffers.
CI_MODULES: tuple[str, ...] = (
    "nn.Linear", "nn.Bilinear", "nn.Embedding", "nn.LayerNorm", "nn.RMSNorm", "nn.GroupNorm",
    "nn.BatchNorm2d", "nn.Conv2d", "nn.ConvTranspose1d", "nn.MaxPool2d", "nn.AvgPool2d",
    "nn.AdaptiveAvgPool2d", "nn.GELU", "nn.SiLU", "nn.Softmax", "nn.MultiheadAttention",
    "nn.TransformerEncoderLayer", "nn.LSTM", "nn.GRUCell", "nn.CrossEntropyLoss", "nn.NLLLoss",
    "nn.MSELoss", "nn.ReflectionPad2d", "nn.FractionalMaxPool2d",
)
# Inputs per (module, dtype) in the CI subset: None runs them all.
CI_MAX_INPUTS: int | None = 4


def module_db() -> list[Any]:
    # Imported late: common_device_type must see the neuron backend already loaded.
    from torch.testing._internal.common_modules import module_db as db

    return list(db)


def modules_by_name() -> dict[str, Any]:
    return {m.name: m for m in module_db()}


def cases(names: tuple[str, ...] | None = None) -> list[tuple[Any, str]]:
    """(ModuleInfo, dtype name) for every module and every dtype of DTYPES."""
    infos = module_db() if names is None else [modules_by_name()[n] for n in names]
    return [(m, d) for m in infos for d in DTYPES]


def _build(info: Any, mi: Any, dtype: torch.dtype, training: bool) -> torch.nn.Module:
    """The module on CPU, seeded, in `dtype`; lazy parameters materialized on CPU."""
    torch.manual_seed(0)
    m = info.module_cls(*mi.constructor_input.args, **mi.constructor_input.kwargs)
    m.to(dtype)
    m.train(training)
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in m.parameters()):
        with torch.no_grad():
            m(*ops_sweep.move(mi.forward_input.args, "cpu", False),
              **ops_sweep.move(mi.forward_input.kwargs, "cpu", False))
        m.to(dtype)
    return m


def _cast(obj: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors of `obj` in `dtype` (same values; grads kept), others as they are."""
    if dtype is None:
        return obj

    def f(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().to(dtype).requires_grad_(t.requires_grad)
        return t
    return tree_map(f, obj)


def evaluate(info: Any, mi: Any, dtype: torch.dtype, training: bool, device: str, seed: int,
             upcast: torch.dtype | None = None) -> tuple[dict[str, Any], bool]:
    """Forward + backward of one module input on `device`: ({name: output, buffer or
    gradient}, whether random numbers were drawn). With `upcast`, the same values run in
    that dtype (the float64 reference of a 16-bit run)."""
    m = _build(info, mi, dtype, training)
    if upcast is not None:
        m.to(upcast)
    m.to(device)
    args, kwargs = _cast(ops_sweep.move((mi.forward_input.args, mi.forward_input.kwargs),
                                        device, True), upcast)
    with ops_sweep.RandomOpDetector() as det:
        out = m(*args, **kwargs)
    leaves, _ = tree_flatten(out)
    got: dict[str, Any] = {f"output[{i}]": x for i, x in enumerate(leaves)}
    got.update({f"buffer {n}": b for n, b in m.named_buffers()})
    outs = ops_sweep.diff_outputs(out)
    named = list(m.named_parameters())
    inputs = ops_sweep.grad_leaves((args, kwargs))
    if outs and (named or inputs) and not det.random:
        gen = torch.Generator().manual_seed(seed)
        weights = [torch.randn(o.shape, dtype=dtype, generator=gen).to(o.dtype).to(device)
                   for o in outs]
        try:
            grads = torch.autograd.grad(outs, [p for _, p in named] + inputs, weights,
                                        allow_unused=True)
        except RuntimeError as e:
            if device != "cpu":
                raise
            grads = ()  # backward unsupported on CPU: nothing to compare
            got["backward"] = ops_sweep.short_error(e)
        names = [f"grad of {n}" for n, _ in named] + [f"grad of input {k}"
                                                      for k in range(len(inputs))]
        got.update({n: g for n, g in zip(names, grads, strict=False) if g is not None})
    return got, det.random


def _compare(n: dict[str, Any], c: dict[str, Any], where: str, values: bool) -> None:
    if sorted(n) != sorted(c):
        raise AssertionError(f"{where}: neuron gave {sorted(n)}, CPU {sorted(c)}")
    for k in c:
        if isinstance(c[k], str):
            continue
        ops_sweep.compare(n[k], c[k], f"{where} {k}", values, device=k.startswith("output"))


def _no_worse_than_cpu(n: dict[str, Any], c: dict[str, Any], ref: dict[str, Any],
                       dtype: torch.dtype, where: str) -> None:
    """16-bit: neuron at most twice as far from the float64 run as CPU is (+ tolerance)."""
    atol, _ = ops_sweep.TOLERANCES[dtype]
    for k, r in ref.items():
        if not isinstance(r, torch.Tensor) or not r.is_floating_point():
            continue
        r = r.detach().cpu().double()
        err_n = (n[k].detach().cpu().double() - r).abs().max().item()
        err_c = (c[k].detach().cpu().double() - r).abs().max().item()
        if err_n > 2 * err_c + atol * max(1.0, r.abs().max().item()):
            raise AssertionError(f"{where} {k}: neuron is {err_n:.3g} from the float64 run, "
                                 f"CPU {err_c:.3g}")


def run_case(info: Any, dtype_name: str, max_inputs: int | None = None) -> Result:
    """Runs every module input of `info` for one dtype on CPU and neuron and compares them."""
    t0 = time.perf_counter()
    res = Result(info.name, dtype_name, "pass")
    with ops_sweep.sweep_policy(), ops_sweep.tracked(res):
        _run(info, DTYPES[dtype_name], max_inputs, res)
    res.seconds = time.perf_counter() - t0
    return res


def _run(info: Any, dtype: torch.dtype, max_inputs: int | None, res: Result) -> None:
    modes = (True, False) if info.train_and_eval_differ else (True,)
    random_runs = runs = 0
    cpu_error = ""
    variants: set[str] = set()
    for training in modes:
        torch.manual_seed(0)
        try:
            inputs = info.module_inputs_func(info, device="cpu", dtype=dtype,
                                             requires_grad=True, training=training)
        except Exception as e:  # noqa: BLE001
            cpu_error = cpu_error or f"module_inputs_func: {ops_sweep.short_error(e)}"
            continue
        inputs = [mi for mi in inputs if mi.forward_input is not None][:max_inputs]
        for i, mi in enumerate(inputs):
            where = f"input {i} ({'train' if training else 'eval'})"
            try:
                c, random = evaluate(info, mi, dtype, training, "cpu", i)
            except Exception as e:  # noqa: BLE001
                cpu_error = cpu_error or ops_sweep.short_error(e)
                continue
            runs += 1
            random_runs += random
            try:
                n, _ = evaluate(info, mi, dtype, training, DEVICE, i)
                try:
                    _compare(n, c, where, not random)
                except AssertionError:
                    if random or dtype not in LOW_PRECISION:
                        raise
                    ref, _ = evaluate(info, mi, dtype, training, "cpu", i, torch.float64)
                    _no_worse_than_cpu(n, c, ref, dtype, where)
            except Exception as e:  # noqa: BLE001
                res.status, res.detail = "fail", f"{where}: {ops_sweep.short_error(e)}"
                res.samples, res.variants = runs, tuple(sorted(variants))
                return
            variants.add("train" if training else "eval")
            res.grad |= any(k.startswith("grad") for k in c) and not random
    res.samples, res.variants = runs, tuple(sorted(variants))
    if runs == 0:
        res.status, res.detail = "cpu-fail", cpu_error or "no module inputs for this dtype"
    elif random_runs == runs:
        res.status = "skip"
        res.detail = ops_sweep.RANDOM + "; ran on neuron, shapes and dtypes compared"
    elif random_runs:
        res.detail = f"{random_runs} of {runs} runs random: shapes and dtypes compared for those"
