"""Glue the Hugging Face libraries need on `neuron`: as few patches as possible, applied lazily.

transformers 5.24, accelerate 1.15, peft 0.21, trl and diffusers already know the `neuron`
device (`is_torch_neuron_available`, `Accelerator` picking neuron, generate() compiling on
backend `neuron`, `TrainingArguments` choosing `neuron:0`). What was found missing is patched
here, one function per upstream gap, each with its reason. Nothing is imported at `import torch`
time: `register()` asks neuronlocal.patching to patch each module right after it has executed,
so `from module import name` elsewhere already sees the patched name.

Patches (see `PATCHES`):
- accelerate.utils.modeling.get_max_memory: its device list has npu, mlu, sdaa, musa, xpu, hpu
  and cuda but no neuron, so `device_map="auto"` finds no accelerator and puts the whole model
  on the CPU. On neuron it now returns each logical core's free HBM (as for a GPU).
- kernels.kernelize (HF `kernels` 0.17): `kernelize(model, device="neuron")` swapped nothing
  and said nothing: no mapping names a layer for neuron, and transformers only marks its
  layers kernelizable with kernels>=0.18.2. On neuron it now installs neuronlocal's local
  layer mapping first (neuronlocal.kernels.hub.register: Llama's RMSNorm, MLP and rotary),
  and warns when still no layer of the model was swapped.
- transformers.integrations.hub_kernels.get_device_type (transformers 5.25): `kernelize()`
  takes the execution device from `device_map`'s first accelerator value, which accelerate
  writes as a core index (`0`), and `get_device_type(0)` reads `.type` of that int, so every
  `device_map="auto"` load with `kernels` installed raises AttributeError. An index now means
  a core of the current accelerator.
- transformers.utils.kernel_config.add_to_mapping_local (transformers 5.25):
  `register_kernel_replacements_and_fusions` rewrites a `KernelConfig`'s mapping into
  `(repo, metadata)` tuples, local repositories too, and `add_to_mapping_local` then splits
  the tuple as a string, so `use_kernels=True` with a local `KernelConfig` raises. The repo
  string is taken from the tuple.
- transformers.generation.utils.GenerationMixin.generate: observed, not changed. generate()
  calls the model's own forward, so after `torch.compile(model)` it runs uncompiled; a first
  generate() of a model that compiled nothing while a `torch.compile` wrapper of that model
  exists is counted (`hf_generate_bypassed_compile`) and the run report says so.
- transformers.modeling_utils.PreTrainedModel._finalize_model_loading: observed, not changed.
  Weight loads are counted (`hf_weight_loads`), for the report's HF_DEACTIVATE_ASYNC_LOAD note.

Checked and left alone (no patch needed): `attn_implementation="flex_attention"` (runs under
torch.compile, as on TorchNeuron: neuronlocal.compile.flex), the threaded weight loader (with
and without HF_DEACTIVATE_ASYNC_LOAD=1), peft.utils.infer_device (returns "cpu"; adapters
still load onto the model's device through load_state_dict), accelerate's `Accelerator`,
TRL's SFTTrainer, diffusers pipelines.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from neuronlocal import device as neuron
from neuronlocal import patching
from neuronlocal.core import counters as core_counters
from neuronlocal.core import dynamo_metrics


def _neuron_is_the_accelerator() -> bool:
    """True when neuron is the device accelerate should place weights on (no CUDA present)."""
    return bool(neuron.is_available()) and not torch.cuda.is_available()


def _patch_accelerate_modeling(mod: Any) -> None:
    """accelerate 1.15 get_max_memory: add neuron cores (upstream lists every device but neuron)."""
    original: Callable[..., dict[int | str, int]] = mod.get_max_memory
    if getattr(original, "_neuronlocal", False):
        return

    def get_max_memory(max_memory: dict[int | str, int | str] | None = None
                       ) -> dict[int | str, int]:
        if not _neuron_is_the_accelerator():
            return original(max_memory)
        count = neuron.device_count()
        if max_memory is None:
            import psutil

            out: dict[int | str, int] = {
                i: neuron.mem_get_info(i)[0] for i in range(count)}
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


def _patch_transformers_modeling(mod: ModuleType) -> None:
    """PreTrainedModel._finalize_model_loading: counts weight loads (observed, not changed)."""
    cls = mod.PreTrainedModel
    original_finalize = cls._finalize_model_loading
    if getattr(original_finalize, "_neuronlocal", False):
        return

    def _finalize_model_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        info = original_finalize(model, *args, **kwargs)
        core_counters.increment("hf_weight_loads")
        return info

    _finalize_model_loading._neuronlocal = True  # type: ignore[attr-defined]
    cls._finalize_model_loading = staticmethod(_finalize_model_loading)


def _swapped(model: torch.nn.Module) -> dict[str, int]:
    """{layer class: modules} whose forward `kernels` replaced with a kernel layer's."""
    out: dict[str, int] = {}
    for m in model.modules():
        if getattr(m.forward, "__func__", None) not in (None, type(m).forward):
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def _patch_kernels(mod: Any) -> None:
    """kernels.kernelize: on neuron, neuronlocal's layer mapping first; never silently a no-op."""
    original = mod.kernelize
    if getattr(original, "_neuronlocal", False):
        return

    def kernelize(model: torch.nn.Module, *, mode: Any, device: Any = None,
                  use_fallback: Any = True) -> Any:
        params = next(iter(model.parameters()), None)
        where = device if device is not None else (params.device if params is not None
                                                   else None)
        on_neuron = where is not None and torch.device(where).type == "neuron"
        if on_neuron:
            from neuronlocal.kernels import hub

            hub.register()
            hub.attach_funcs(model)
        out = original(model, mode=mode, device=device, use_fallback=use_fallback)
        swapped = _swapped(model) if on_neuron else {}
        if swapped:
            core_counters.record_kernel_swap(type(model).__name__, swapped)
        if on_neuron and not swapped:
            warnings.warn(
                f"kernels.kernelize(device='neuron') swapped no layer of "
                f"{type(model).__name__}: no kernel mapping names one of its layers for neuron "
                "(neuronlocal maps Llama-style RMSNorm, gated MLP and rotary embedding; see "
                "neuronlocal.kernels.kernel_mapping). The model runs its own layers.",
                stacklevel=2)
        return out

    kernelize._neuronlocal = True  # type: ignore[attr-defined]
    kernelize.__doc__ = original.__doc__
    mod.kernelize = kernelize
    if getattr(mod, "layer", None) is not None and getattr(mod.layer, "kernelize", None) \
            is original:
        mod.layer.kernelize = kernelize


def _patch_transformers_hub_kernels(mod: Any) -> None:
    """hub_kernels.get_device_type: a device-map core index names a core of the accelerator.

    transformers 5.25 `kernelize()` sets `model._kernels_device` to
    `next(iter(set(device_map.values()) - {"cpu", "disk"}))`, an int for accelerate's maps.
    """
    original = mod.get_device_type
    if getattr(original, "_neuronlocal", False):
        return

    def get_device_type(device: Any = None) -> str:
        if isinstance(device, int) and not isinstance(device, bool):
            accelerator = torch.accelerator.current_accelerator()
            device = torch.device(accelerator.type if accelerator else "cpu", device)
        return original(device)

    get_device_type._neuronlocal = True  # type: ignore[attr-defined]
    mod.get_device_type = get_device_type


def _patch_transformers_kernel_config(mod: Any) -> None:
    """kernel_config.add_to_mapping_local: accept the `(repo, metadata)` tuple 5.25 stores.

    transformers 5.25 `register_kernel_replacements_and_fusions` ends with
    `kernel_config.kernel_mapping = new_mapping` of `(repo_str, metadata)` tuples, and
    `add_to_mapping_local` does `repo_name.split(":")` on them.
    """
    original = mod.add_to_mapping_local
    if getattr(original, "_neuronlocal", False):
        return

    def add_to_mapping_local(layer_name: Any, device: Any, repo_name: Any, mode: Any,
                             compatible_mapping: Any) -> Any:
        if isinstance(repo_name, tuple):
            repo_name = repo_name[0]
        return original(layer_name, device, repo_name, mode, compatible_mapping)

    add_to_mapping_local._neuronlocal = True  # type: ignore[attr-defined]
    mod.add_to_mapping_local = add_to_mapping_local


_generated: set[int] = set()  # ids of models whose first generate() was looked at


def _compiled_elsewhere(model: Any) -> bool:
    """Whether a `torch.compile(model)` wrapper of `model` exists while its own forward is
    not compiled (generate() then runs the model uncompiled)."""
    import gc

    from torch._dynamo.eval_frame import OptimizedModule

    if hasattr(model.forward, "_torchdynamo_orig_callable"):
        return False
    return any(isinstance(o, OptimizedModule) and o._orig_mod is model
               for o in gc.get_objects())


def _patch_transformers_generation(mod: ModuleType) -> None:
    """GenerationMixin.generate: notes a first generate() that went around torch.compile."""
    cls = mod.GenerationMixin
    original = cls.generate
    if getattr(original, "_neuronlocal", False):
        return

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Only a neuron model's generate() matters to the run report; the search for a
        # compiled wrapper walks every live object, which is not free.
        on_neuron = getattr(getattr(self, "device", None), "type", None) == "neuron"
        first = on_neuron and id(self) not in _generated
        if first:
            _generated.add(id(self))
        before = dynamo_metrics.next_graph_id()
        try:
            return original(self, *args, **kwargs)
        finally:
            if first and dynamo_metrics.next_graph_id() == before:
                with contextlib.suppress(Exception):  # an observation only
                    if _compiled_elsewhere(self):
                        core_counters.increment("hf_generate_bypassed_compile")

    generate._neuronlocal = True  # type: ignore[attr-defined]
    cls.generate = generate


# module name -> patch, applied once right after the module has executed.
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "accelerate.utils.modeling": _patch_accelerate_modeling,
    "transformers.modeling_utils": _patch_transformers_modeling,
    "kernels": _patch_kernels,
    "transformers.integrations.hub_kernels": _patch_transformers_hub_kernels,
    "transformers.utils.kernel_config": _patch_transformers_kernel_config,
    "transformers.generation.utils": _patch_transformers_generation,
}


def register() -> None:
    """Patches the modules in PATCHES when they are imported (or now, if they are)."""
    for name, patch in PATCHES.items():
        patching.after_import(name, patch)


def applied() -> list[str]:
    """Hugging Face modules patched so far in this process (for tests and `neuronlocal info`)."""
    return [name for name in patching.applied() if name in PATCHES]
