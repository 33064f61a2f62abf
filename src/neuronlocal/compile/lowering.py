"""Stock Inductor as neuron graphs use it: the optimisation level's settings, the lowering
fixes, and Inductor's own compile_fx.

The compile stage (compile/static.py) calls these for every Inductor compile; the cache
(compile/cache.py) names its Inductor folder by the fixes' version; the default-backend seam
(compile/inductor.py) keeps the stock compile_fx here before it routes neuron graphs.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from neuronlocal.core.config import env_optlevel

_STOCK: dict[str, Callable[..., Any]] = {}
# Inductor settings per optimisation level (NEURON_CC_FLAGS). Level 1 trades run time for
# compile time, as neuronx-cc's -O1 does: the whole graph in one C++ file (one compiler run
# instead of one per kernel), scalar loops (no vector-tiling search), no C++ optimisation.
# Small graphs compile about 2.5x faster; results match level 2 within float rounding.
OPTLEVEL_PATCHES: dict[int, dict[str, Any]] = {
    1: {"cpp_wrapper": True, "cpp.simdlen": 1, "aot_inductor.debug_compile": True},
    2: {},
    3: {},
}
# Inductor lowerings that compute wrong results in this PyTorch, and the ATen kernels neuron
# graphs use instead (TorchNeuron's compiler computes these ops like the eager kernels):
# average-pool backward with ceil_mode divides a last window that overhangs the input by the
# whole kernel, where eager divides by the part inside the padded input.
# Bump LOWERING_FIXES when this changes: it names the Inductor cache folder, so no graph
# compiled by the wrong lowering is served again.
LOWERING_FIXES = 1
_FIX_CEIL_POOL = ("avg_pool2d_backward", "avg_pool3d_backward")
_fixing: contextvars.ContextVar[bool] = contextvars.ContextVar("neuron_fixing", default=False)


def optlevel_patches() -> dict[str, Any]:
    """Inductor config patches of the optimisation level NEURON_CC_FLAGS sets now."""
    return dict(OPTLEVEL_PATCHES[env_optlevel()])


def install_lowering_fixes(lowering: ModuleType) -> None:
    """Wraps the wrong lowerings of Inductor's `lowering` module, once, right after it is
    imported (compile/inductor.py registers this), so a compile that never lowers (a cache
    hit) never imports it; the wrapper diverts only inside `lowering_fixes()`, so Inductor's
    CPU compiles outside neuron's stay exactly stock."""
    for name in _FIX_CEIL_POOL:
        op = getattr(torch.ops.aten, name).default
        stock = lowering.lowerings.get(op)
        if stock is None or getattr(stock, "_neuronlocal", False):
            continue
        fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

        def fixed(*args: Any, _stock: Any = stock, _fallback: Any = fallback, **kwargs: Any
                  ) -> Any:
            ceil_mode = args[5] if len(args) > 5 else kwargs.get("ceil_mode", False)
            use = _fallback if ceil_mode and _fixing.get() else _stock
            return use(*args, **kwargs)

        fixed._neuronlocal = True  # type: ignore[attr-defined]
        lowering.lowerings[op] = fixed


@contextlib.contextmanager
def lowering_fixes() -> Iterator[None]:
    """Within: Inductor lowers the ops of `_FIX_CEIL_POOL` with ceil_mode to ATen kernels."""
    token = _fixing.set(True)
    try:
        yield
    finally:
        _fixing.reset(token)


def stock_compile_fx(mod: ModuleType | None = None) -> Callable[..., Any]:
    """Inductor's own compile_fx (the neuron backend compiles CPU graphs with it). `mod`:
    Inductor's compile_fx module, handed over before the seam replaces its function."""
    if "compile_fx" not in _STOCK:
        mod = mod or importlib.import_module("torch._inductor.compile_fx")
        _STOCK.setdefault("compile_fx", mod.compile_fx)
    return _STOCK["compile_fx"]
