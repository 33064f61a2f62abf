"""PyTorch's OpInfo database run on neuron vs CPU: the conformance sweep.

For each OpInfo in `op_db` and each dtype of `DTYPES` that the OpInfo supports on CPU,
the sample inputs are generated once, on CPU (seeded), and every sample is run

- on CPU, on layout-preserving copies of the inputs (same sizes, strides and offsets),
- on neuron, on layout-preserving copies of the same inputs,

and the outputs (and any inputs the op mutates) are compared with
`torch.testing.assert_close`. For float dtypes where the OpInfo supports autograd, the
gradients of a weighted sum of the outputs w.r.t. every input are compared too (the
weights are drawn once on CPU and copied). Where the OpInfo has them, the in-place variant
and the `out=` variant (with an empty `out`, so the kernel has to resize it) are run and
compared as well.

A pair "passes on CPU" if at least one of its samples runs on CPU; samples that raise on
CPU are not run on neuron. Random ops (detected by the CPU generator advancing) and ops
that return uninitialized memory are run on neuron too, but only shapes and dtypes are
compared; they count as skipped, with the reason.

The sweep runs with the 64-bit downcast policy off, so int64 results are compared exactly
(with it on, int64 pointwise ops compute in int32 on neuron, by design).

Used by tests/test_opinfo.py (full sweep: -m slow; `CI_OPS`: by default) and by
tools/op_support.py, which writes docs/op-support.md and docs/op-support.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = "neuron"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}
# (atol, rtol) by the dtype of the compared tensor. Both sides run the same CPU kernel, so
# differences come only from alignment-dependent vectorization and accumulation order.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1e-4, 1e-4),
}

# Ops whose values are not comparable by construction: ran, shape/dtype compared only.
UNINITIALIZED = "returns uninitialized memory: values are not comparable"
VALUE_SKIPS: dict[str, str] = {
    "empty": UNINITIALIZED,
    "empty_like": UNINITIALIZED,
    "empty_strided": UNINITIALIZED,
    "empty_permuted": UNINITIALIZED,
    "new_empty": UNINITIALIZED,
    "new_empty_strided": UNINITIALIZED,
    "resize_": UNINITIALIZED,
    "resize_as_": UNINITIALIZED,
}
RANDOM_ATEN = {"aten::native_dropout", "aten::rand", "aten::randn", "aten::randint",
               "aten::randperm", "aten::rand_like", "aten::randn_like", "aten::randint_like"}
RANDOM = ("random op: values depend on the generator (neuron draws from CPU's global generator, "
          "at its own point of the stream)")

# OpInfos whose samples put some tensors on CPU on purpose, whatever the device (CUDA
# requires them there too): only the sample's input goes to neuron.
CPU_ARGS: dict[str, str] = {
    "tensor_split": "tensor_indices_or_sections must be a CPU tensor (as on CUDA)",
}

# Known neuron-only failures, each with its reason (tests mark them xfail).
_SPARSE = ("sparse layouts: neuron supports strided tensors only, as TorchNeuron does "
           "(run sparse ops on CPU)")
KNOWN_FAILURES: dict[str, str] = {
    "to_sparse": _SPARSE,
    "sparse.sampled_addmm": _SPARSE,
    "sparse.mm.reduce": _SPARSE,
}

# The fixed subset CI runs by default: elementwise, reductions, the matmul family,
# indexing, shape/view ops, nn.functional, in-place and out= variants (the sweep runs
# those for every OpInfo that has them), and one random op.
CI_OPS: tuple[str, ...] = (
    # elementwise
    "add", "sub", "mul", "div.no_rounding_mode", "abs", "neg", "exp",
    "log", "rsqrt", "sigmoid", "tanh", "pow", "clamp", "where", "maximum", "eq",
    "bitwise_and", "lerp", "masked_fill",
    # reductions
    "sum", "mean", "amax", "argmax", "max.reduction_with_dim", "cumsum", "var",
    "logsumexp", "all", "topk", "sort", "mode", "linalg.vector_norm",
    # matmul family
    "mm", "bmm", "matmul", "addmm", "einsum", "nn.functional.linear",
    # indexing
    "index_select", "gather", "scatter", "scatter_add", "index_put", "index_add",
    "__getitem__", "masked_select", "nonzero",
    # shape and view ops
    "view", "reshape", "permute", "transpose", "expand", "cat", "stack", "squeeze",
    "unsqueeze", "flatten", "split", "flip", "roll", "as_strided",
    "tril", "repeat", "diagonal",
    # nn.functional
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.conv2d",
    "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.scaled_dot_product_attention", "nn.functional.gelu", "nn.functional.relu",
    "nn.functional.group_norm", "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d", "nn.functional.pad.constant", "nn.functional.mse_loss",
    "nn.functional.nll_loss", "nn.functional.interpolate.bilinear",
    # random
    "nn.functional.dropout",
)
# Samples per pair in the CI subset: None runs them all (about 15 s for the subset).
CI_MAX_SAMPLES: int | None = None


@dataclasses.dataclass
class Result:
    op: str
    dtype: str
    status: str  # "pass", "fail" (neuron only), "cpu-fail" (fails on CPU too), "skip"
    detail: str = ""
    samples: int = 0  # samples that ran on CPU (and so were compared)
    grad: bool = False  # gradients were compared
    variants: tuple[str, ...] = ()  # in-place / out= variants compared
    seconds: float = 0.0
    ops: tuple[str, ...] = ()  # ATen ops that ran on neuron (their placement: eager.ops)
    fallbacks: tuple[str, ...] = ()  # those TorchNeuron would run on the host

    @property
    def id(self) -> str:
        return f"{self.op}-{self.dtype}"


def op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db() -> list[Any]:
    # Imported late: common_device_type must see the neuron backend already loaded.
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def ops_by_name() -> dict[str, Any]:
    return {op_name(op): op for op in op_db()}


def cases(names: tuple[str, ...] | None = None) -> list[tuple[Any, str]]:
    """(OpInfo, dtype name) for every dtype of DTYPES the OpInfo supports on CPU."""
    if names is None:
        ops = op_db()
    else:
        by_name = ops_by_name()
        ops = [by_name[n] for n in names]
    out = []
    for op in ops:
        supported = op.supported_dtypes("cpu")
        for dname, dtype in DTYPES.items():
            if dtype in supported:
                out.append((op, dname))
    return out


@contextlib.contextmanager
def sweep_policy() -> Iterator[None]:
    """64-bit downcast off (exact int64 comparison), not strict, Trainium's op placement
    (so fallbacks are recorded), warnings silenced."""
    from neuronlocal.core import state
    from neuronlocal.eager import set_policy

    cfg = state.config
    set_policy(downcast_64bit=False, strict=False, placement="trainium")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        set_policy(downcast_64bit=cfg.downcast_64bit, strict=cfg.strict,
                   placement=cfg.placement)


@contextlib.contextmanager
def tracked(res: Result) -> Iterator[None]:
    """Records in `res` the ATen ops that ran on neuron and those that fell back to the host
    (op tracking is cleared first: the counts of the process are not kept)."""
    from neuronlocal.eager import tracking

    tracking.clear_op_tracking()
    try:
        yield
    finally:
        res.ops = tuple(sorted(tracking.get_executed_ops()))
        res.fallbacks = tuple(sorted(tracking.get_fallback_ops()))
        tracking.clear_op_tracking()


# ---- moving samples ----------------------------------------------------------------------


def copy_tensor(t: torch.Tensor, device: str, grad: bool) -> torch.Tensor:
    """A fresh leaf on `device` with t's values, sizes, strides and storage offset."""
    if t.layout != torch.strided:
        c = t.detach().to(device)
    else:
        st = t.untyped_storage()
        n = st.nbytes() // t.element_size()
        flat = t.detach().new_empty(0).set_(st, 0, (n,), (1,))
        flat = flat.clone() if device == "cpu" else flat.to(device)
        c = flat.as_strided(t.shape, t.stride(), t.storage_offset()).detach()
    if grad and t.requires_grad:
        c.requires_grad_(True)
    return c


def _is_cpu_device(v: Any) -> bool:
    if isinstance(v, torch.device):
        return v.type == "cpu"
    return isinstance(v, str) and v == "cpu"


def move(obj: Any, device: str, grad: bool) -> Any:
    def f(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x, device, grad)
        if device != "cpu" and _is_cpu_device(x):
            return torch.device(device)
        return x

    return tree_map(f, obj)


class RandomOpDetector(TorchDispatchMode):
    """Notes whether any ATen op that draws random numbers ran (one with a Generator
    argument, or native_dropout). Seen below autograd, so it also catches OpInfos that
    reseed around the op (wrapper_set_seed), where the generator state looks unchanged."""

    _cache: dict[Any, bool] = {}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    @classmethod
    def is_random(cls, func: Any) -> bool:
        r = cls._cache.get(func)
        if r is None:
            schema = func._schema
            r = schema.name in RANDOM_ATEN or any(
                "Generator" in str(a.type) for a in schema.arguments)
            cls._cache[func] = r
        return r

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if not self.random and self.is_random(func):
            self.random = True
        return func(*args, **(kwargs or {}))


def move_sample(s: Any, device: str, grad: bool, op: str) -> tuple[Any, tuple, dict]:
    """(input, args, kwargs) of a sample, copied to `device` (see CPU_ARGS)."""
    if device != "cpu" and op in CPU_ARGS:
        return (move(s.input, device, grad), move(s.args, "cpu", grad),
                move(s.kwargs, "cpu", grad))
    return move((s.input, s.args, s.kwargs), device, grad)


def _call(fn: Any, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


# ---- comparing ---------------------------------------------------------------------------


class Tolerance(TypedDict):
    atol: float
    rtol: float


def _tol(dtype: torch.dtype, ref: torch.Tensor | None = None) -> Tolerance:
    """Tolerances by dtype. For 16-bit floats atol scales with the largest magnitude of
    the reference: results that cancel (sums of many rounded terms) differ by a few ulps
    of the terms, not of the result."""
    atol, rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    if ref is not None and dtype in (torch.bfloat16, torch.float16) and ref.numel():
        big = ref.detach().abs().float().nan_to_num(0.0, 0.0, 0.0).max().item()
        atol *= max(1.0, big)
    return {"atol": atol, "rtol": rtol}


def _prefixed(where: str) -> Callable[[str], str]:
    """assert_close's message, prefixed with where the values came from."""
    return lambda message: f"{where}: {message}"


def on_neuron(obj: Any) -> bool:
    """Whether a call's arguments name neuron (a tensor or a device on it)."""
    leaves, _ = tree_flatten(obj)
    return any((isinstance(x, torch.Tensor) and x.device.type == DEVICE)
               or (isinstance(x, torch.device) and x.type == DEVICE) for x in leaves)


def compare(actual: Any, expected: Any, what: str, values: bool = True,
            device: bool = True) -> None:
    """assert_close per result; with `device`, tensor results must be on neuron."""
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if len(a_leaves) != len(e_leaves):
        raise AssertionError(f"{what}: {len(a_leaves)} results on neuron, {len(e_leaves)} on CPU")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        where = f"{what}[{i}]" if len(e_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(f"{where}: neuron returned {type(a).__name__}, not a tensor")
            if device and a.device.type != DEVICE:
                raise AssertionError(f"{where}: result on {a.device}, expected neuron")
            if a.shape != e.shape or a.dtype != e.dtype:
                raise AssertionError(f"{where}: neuron {a.dtype}{list(a.shape)} vs "
                                     f"CPU {e.dtype}{list(e.shape)}")
            if not values:
                continue
            ac = a.detach().to("cpu")
            torch.testing.assert_close(ac, e.detach(), equal_nan=True, check_stride=False,
                                       msg=_prefixed(where), **_tol(e.dtype, e))
        elif isinstance(e, torch.device) or _is_cpu_device(e):
            continue  # a device argument: neuron's copy names neuron
        elif values and isinstance(e, float):
            torch.testing.assert_close(a, e, equal_nan=True, **_tol(torch.float32))
        elif values and isinstance(e, int | bool | str | torch.dtype | torch.Size):
            if a != e:
                raise AssertionError(f"{where}: neuron {a!r} vs CPU {e!r}")


def diff_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad
            and (t.is_floating_point() or t.is_complex())]


def grad_leaves(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]


def _grads(out: Any, inputs: Any, weights: list[torch.Tensor]) -> tuple:
    outs = diff_outputs(out)
    leaves = grad_leaves(inputs)
    return torch.autograd.grad(outs, leaves, weights, allow_unused=True)


def short_error(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:4])
    return f"{type(e).__name__}: {text[:400]}"


# ---- one (op, dtype) pair ----------------------------------------------------------------


def run_case(op: Any, dtype_name: str, max_samples: int | None = None) -> Result:
    """Runs every sample of `op` for one dtype on CPU and neuron and compares them."""
    t0 = time.perf_counter()
    name = op_name(op)
    res = Result(name, dtype_name, "pass")
    with sweep_policy(), tracked(res):
        _run(op, DTYPES[dtype_name], max_samples, res)
    res.seconds = time.perf_counter() - t0
    return res


def _run(op: Any, dtype: torch.dtype, max_samples: int | None, res: Result) -> None:
    grad = bool(op.supports_autograd) and (dtype.is_floating_point or dtype.is_complex)
    torch.manual_seed(0)
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))
    except Exception as e:  # noqa: BLE001
        res.status, res.detail = "cpu-fail", f"sample_inputs: {short_error(e)}"
        return
    if max_samples is not None:
        samples = samples[:max_samples]
    if not samples:
        res.status, res.detail = "skip", "the OpInfo has no samples for this dtype"
        return
    value_skip = VALUE_SKIPS.get(res.op) or VALUE_SKIPS.get(op.name)
    random_samples = 0
    cpu_error = ""
    variants: set[str] = set()
    for i, s in enumerate(samples):
        stage = "forward"
        try:
            # CPU reference, on fresh copies (the op may mutate its inputs).
            c_in = move_sample(s, "cpu", grad, res.op)
            try:
                with RandomOpDetector() as det:
                    c_out = _call(op, (c_in[0], *c_in[1]), c_in[2])
            except Exception as e:  # noqa: BLE001
                cpu_error = cpu_error or short_error(e)
                continue
            res.samples += 1
            values = not (det.random or value_skip)
            random_samples += det.random
            n_in = move_sample(s, DEVICE, grad, res.op)
            n_out = _call(op, (n_in[0], *n_in[1]), n_in[2])
            compare(n_out, c_out, f"sample {i} output", values, on_neuron(n_in))
            compare(n_in, c_in, f"sample {i} inputs after the op", values, device=False)
            if grad and values:
                stage = "backward"
                _check_grad(s, c_in, c_out, n_in, n_out, res, i)
            if op.inplace_variant is not None and isinstance(s.input, torch.Tensor):
                stage = "in-place"
                if _check_inplace(op, s, values, i):
                    variants.add("in-place")
            if op.supports_out:
                stage = "out="
                if _check_out(op, s, values, i):
                    variants.add("out=")
        except Exception as e:  # noqa: BLE001
            res.status = "fail"
            res.detail = f"sample {i} {stage}: {short_error(e)}"
            res.variants = tuple(sorted(variants))
            return
    res.variants = tuple(sorted(variants))
    if res.samples == 0:
        res.status, res.detail = "cpu-fail", cpu_error
    elif value_skip or random_samples == res.samples:
        res.status = "skip"
        res.detail = (value_skip or RANDOM) + "; ran on neuron, shapes and dtypes compared"
    elif random_samples:
        res.detail = (f"{random_samples} of {res.samples} samples random: shapes and dtypes "
                      "compared for those")


def _check_grad(s: Any, c_in: Any, c_out: Any, n_in: Any, n_out: Any, res: Result,
                i: int) -> None:
    c_o = s.output_process_fn_grad(c_out)
    if not diff_outputs(c_o) or not grad_leaves(c_in):
        return
    gen = torch.Generator().manual_seed(i)
    weights = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in diff_outputs(c_o)]
    try:
        c_g = _grads(c_o, c_in, weights)
    except Exception:  # noqa: BLE001  (backward unsupported on CPU: nothing to compare)
        return
    n_o = s.output_process_fn_grad(n_out)
    n_g = _grads(n_o, n_in, [w.to(DEVICE) for w in weights])
    if len(n_g) != len(c_g):
        raise AssertionError(f"sample {i}: {len(n_g)} gradients on neuron, {len(c_g)} on CPU")
    for k, (a, e) in enumerate(zip(n_g, c_g, strict=True)):
        if (a is None) != (e is None):
            raise AssertionError(f"sample {i} grad[{k}]: None on one side only")
        if e is not None:
            compare(a, e, f"sample {i} grad[{k}]")
    res.grad = True


def _check_inplace(op: Any, s: Any, values: bool, i: int) -> bool:
    c_in = move_sample(s, "cpu", False, op_name(op))
    try:
        c_out = _call(op.inplace_variant, (c_in[0], *c_in[1]), c_in[2])
    except Exception:  # noqa: BLE001  (e.g. promotion the in-place op cannot do)
        return False
    n_in = move_sample(s, DEVICE, False, op_name(op))
    n_out = _call(op.inplace_variant, (n_in[0], *n_in[1]), n_in[2])
    if isinstance(c_out, torch.Tensor) and c_out is c_in[0] and n_out is not n_in[0]:
        raise AssertionError(f"sample {i} in-place: did not return its input")
    compare(n_out, c_out, f"sample {i} in-place output", values)
    compare(n_in, c_in, f"sample {i} in-place inputs", values, device=False)
    return True


def _check_out(op: Any, s: Any, values: bool, i: int) -> bool:
    c_in = move_sample(s, "cpu", False, op_name(op))
    try:
        with torch.no_grad():
            ref = _call(op, (c_in[0], *c_in[1]), c_in[2])
    except Exception:  # noqa: BLE001
        return False
    leaves, spec = tree_flatten(ref)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        return False

    def empty_outs(device: str) -> Any:
        outs = [torch.empty(0, dtype=t.dtype, device=device) for t in leaves]
        return outs[0] if isinstance(ref, torch.Tensor) else tuple(outs)

    c_in = move_sample(s, "cpu", False, op_name(op))
    c_outs = empty_outs("cpu")
    try:
        c_ret = _call(op, (c_in[0], *c_in[1]), {**c_in[2], "out": c_outs})
    except Exception:  # noqa: BLE001  (out= unsupported for this sample on CPU)
        return False
    n_in = move_sample(s, DEVICE, False, op_name(op))
    n_outs = empty_outs(DEVICE)
    n_ret = _call(op, (n_in[0], *n_in[1]), {**n_in[2], "out": n_outs})
    compare(n_outs, c_outs, f"sample {i} out= tensors", values)
    compare(n_ret, c_ret, f"sample {i} out= result", values)
    return True


def summarize(results: list[Result]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    cpu_pass = counts.get("pass", 0) + counts.get("fail", 0)
    rate = counts.get("pass", 0) / cpu_pass if cpu_pass else 1.0
    return {"pairs": len(results), "counts": counts, "compared": cpu_pass, "pass_rate": rate}
