"""Glue the Hugging Face libraries need on `neuron`: as few patches as possible, applied lazily.

transformers 5.24, accelerate 1.15, peft 0.21, trl and diffusers already know the `neuron`
device (`is_torch_neuron_available`, `Accelerator` picking neuron, generate() compiling on
backend `neuron`, `TrainingArguments` choosing `neuron:0`). What was found missing is patched
here, one function per upstream gap, each with its reason. Nothing is imported at `import torch`
time: `register()` installs an import hook that patches a module right after it has executed,
so `from module import name` elsewhere already sees the patched name.

Patches (see `PATCHES`):
- accelerate.utils.modeling.get_max_memory: its device list has npu, mlu, sdaa, musa, xpu, hpu
  and cuda but no neuron, so `device_map="auto"` finds no accelerator and puts the whole model
  on the CPU. On neuron it now returns each logical core's free HBM (as for a GPU).

Checked and left alone (no patch needed): the threaded weight loader (with and without
HF_DEACTIVATE_ASYNC_LOAD=1), peft.utils.infer_device (returns "cpu"; adapters still load onto
the model's device through load_state_dict), accelerate's `Accelerator`, TRL's SFTTrainer,
diffusers pipelines.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_applied: set[str] = set()


def _neuron_is_the_accelerator() -> bool:
    """True when neuron is the device accelerate should place weights on (no CUDA present)."""
    return bool(torch.neuron.is_available()) and not torch.cuda.is_available()


def _patch_accelerate_modeling(mod: ModuleType) -> None:
    """accelerate 1.15 get_max_memory: add neuron cores (upstream lists every device but neuron)."""
    original: Callable[..., dict[int | str, int]] = mod.get_max_memory
    if getattr(original, "_neuronlocal", False):
        return

    def get_max_memory(max_memory: dict[int | str, int | str] | None = None
                       ) -> dict[int | str, int]:
        if not _neuron_is_the_accelerator():
            return original(max_memory)
        count = torch.neuron.device_count()
        if max_memory is None:
            import psutil

            out: dict[int | str, int] = {
                i: torch.neuron.mem_get_info(i)[0] for i in range(count)}
            out["cpu"] = psutil.virtual_memory().available
            return out
        for k, v in max_memory.items():  # in place, as upstream (transformers relies on it)
            if isinstance(v, str):
                max_memory[k] = mod.convert_file_size_to_int(v)
        sizes: dict[int | str, int] = dict(max_memory)  # type: ignore[arg-type]
        cores = sorted(k for k in sizes if isinstance(k, int))
        bad = [k for k in cores if not 0 <= k < count]
        if bad:
            raise ValueError(f"max_memory names neuron core(s) {bad}, but this process sees "
                             f"{count} (0-{count - 1}); use those indices or set "
                             "NEURON_RT_VISIBLE_CORES / NEURONLOCAL_INSTANCE.")
        other = [k for k in sizes if not isinstance(k, int)]
        unknown = [k for k in other if k not in ("mps", "cpu", "disk")]
        if unknown:
            raise ValueError(f"max_memory has unknown device(s) {unknown}; use core indices "
                             "(0, 1, ...), 'cpu' or 'disk'.")
        order = cores + [k for k in ("mps", "cpu", "disk") if k in sizes]
        return {k: sizes[k] for k in order}

    get_max_memory._neuronlocal = True  # type: ignore[attr-defined]
    get_max_memory.__doc__ = original.__doc__
    mod.get_max_memory = get_max_memory


# module name -> patch, applied once right after the module has executed.
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "accelerate.utils.modeling": _patch_accelerate_modeling,
}


def _apply(name: str, module: ModuleType) -> None:
    with _lock:
        if name in _applied:
            return
        _applied.add(name)
    try:
        PATCHES[name](module)
    except Exception as exc:  # a library version we do not know: leave it unpatched
        logger.warning("neuronlocal.hf: could not patch %s (%s); it runs unpatched.", name, exc)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then our patch for the module."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules in PATCHES."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES or fullname in _applied:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def register() -> None:
    """Patches modules already imported, and the others when they are imported."""
    for name in PATCHES:
        if name in sys.modules:
            _apply(name, sys.modules[name])
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def applied() -> list[str]:
    """Modules patched so far in this process (for tests and `neuronlocal info`)."""
    return sorted(_applied)
