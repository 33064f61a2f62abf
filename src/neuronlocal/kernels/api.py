"""`nki_op` and `wrap_nki`: TorchNeuron's way to expose kernels as PyTorch ops.

On Trainium the kernel body is NKI compiled by neuronx-cc. Here it is Python/PyTorch code
run on the host. `nki_op` builds a `torch.library` custom op whose body is its CPU kernel;
on neuron the C++ eager fallback runs it once on zero-copy CPU aliases of the neuron
arguments and adopts the results as neuron tensors: intermediate ops never go through the
neuron dispatch, so a fused body costs one dispatch instead of one per op. The same body is
what runs inside `torch.compile(backend="neuron")` (the compiled graph runs on CPU
aliases), where the op stays one graph node. The fake implementation defaults to the body
itself run on fake tensors (shape/dtype inference without data).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from neuronlocal import _C, eager

__all__ = ["host_call", "nki_op", "wrap_nki"]


def _alias(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _C._cpu_alias(a) if a.device.type == "neuron" else a
    if isinstance(a, (list, tuple)):
        return type(a)(_alias(x) for x in a)
    return a


def _index(args: Iterable[Any]) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "neuron":
            return a.device.index or 0
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor) and x.device.type == "neuron":
                    return x.device.index or 0
    return 0


def _adopt(out: Any, index: int) -> Any:
    if isinstance(out, torch.Tensor):
        return _C._bridge_out([out], index)[0]
    if isinstance(out, (list, tuple)):
        flat = list(out)
        tensors = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)]
        adopted = _C._bridge_out([flat[i] for i in tensors], index)
        for i, t in zip(tensors, adopted, strict=True):
            flat[i] = t
        return type(out)(flat)
    return out


def host_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn` on CPU aliases of the neuron arguments; adopt its outputs back on neuron.

    Why: one call replaces the per-op neuron dispatch of every op inside `fn`.
    """
    index = _index([*args, *kwargs.values()])
    out = fn(*_alias(args), **{k: _alias(v) for k, v in kwargs.items()})
    return _adopt(out, index)


def _simulated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An NKI kernel (from `nki.jit`) runs through `nki.simulate` when that works here."""
    if not hasattr(fn, "__wrapped__") and type(fn).__module__.split(".")[0] != "nki":
        return fn
    try:
        import nki

        return nki.simulate(fn)
    except Exception:  # nki missing or not a simulator build: run the Python body
        return fn


def nki_op(
    name: str,
    fn: Callable[..., Any] | None = None,
    *,
    mutates_args: Iterable[str] | str = (),
    schema: str | None = None,
) -> Any:
    """Turn a typed Python function into the custom op `name` ("namespace::op") for neuron.

    Use as `@nki_op("mylib::add", mutates_args={})`. The returned op has torch.library's
    `register_fake`, `register_autograd` and `register_kernel`; calling it runs the body on
    the host (one dispatch on neuron, one graph node under torch.compile).
    """
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(
            f"nki_op name {name!r} must be 'namespace::op_name', e.g. 'mylib::rms_norm'."
        )
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        raise ValueError(
            f"nki_op mutates_args={mutates_args!r}: pass a set of argument names, e.g. {{'out'}}."
        )

    def decorate(body: Callable[..., Any]) -> Any:
        params = inspect.signature(body).parameters
        missing = [p for p in params if params[p].annotation is inspect.Parameter.empty]
        if schema is None and missing:
            raise TypeError(
                f"nki_op {name!r}: parameter(s) {missing} of {body.__name__} have no type hints; "
                "annotate them (torch.Tensor, int, float, bool, ...) so a schema can be inferred."
            )
        kernel = _simulated(body)
        # The body is the CPU kernel. On neuron the op reaches the C++ eager fallback like
        # any ATen op: one call that hands the body CPU aliases and adopts its results (and
        # records the op in op tracking), without Python glue around the body.
        op = torch.library.custom_op(
            name, mutates_args=mutates_args, device_types="cpu", schema=schema
        )(kernel)
        op.register_fake(kernel)  # the body on fake tensors infers shapes and dtypes
        eager.add_device_kernel(name)  # an NKI kernel runs on the NeuronCore, not the host
        return op

    return decorate if fn is None else decorate(fn)


class _Launcher:
    """What `wrap_nki(kernel)` returns: callable, and `kernel[grid]` returns a launcher too."""

    def __init__(self, kernel: Callable[..., Any], grid: Any = None) -> None:
        self.kernel, self.grid = _simulated(kernel), grid
        functools.update_wrapper(self, kernel)

    def __getitem__(self, grid: Any) -> _Launcher:
        # The launch grid / LNC selects parallelism on the chip; the host runs one program.
        return _Launcher(self.kernel, grid)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return host_call(self.kernel, *args, **kwargs)


def wrap_nki(kernel: Callable[..., Any]) -> _Launcher:
    """TorchNeuron's older wrapper: `wrap_nki(kernel)[grid](*args)` runs the kernel once."""
    if not callable(kernel):
        raise TypeError(f"wrap_nki expects a kernel function, got {type(kernel).__name__}.")
    return _Launcher(kernel)
