"""torchtitan's training entry point for tests/test_torchtitan.py (torchrun runs it).

`python torchtitan_job.py --make-assets DIR` writes what torchtitan's debug configs read
from `./tests/assets` of a torchtitan checkout (the wheel does not ship them): a small text
data set (`c4_test`) and a byte-level BPE tokenizer. Any other arguments go to torchtitan.

Workarounds of torch-version gaps, here only (torchtitan 0.3.0 on torch 2.13):
- its MoE expert-parallel Triton kernels are imported at import time; torch here has no
  triton, and they run only for CUDA expert parallelism, so that module is a stub;
- it calls `torch.distributed.set_timeout`, torch 2.13's `_set_pg_timeout` under its later
  name.

Run from a checkout of the commit TorchNeuron's tutorials pin (0a2107f9, torchtitan 0.2.1 plus
20 commits; on PYTHONPATH before any installed torchtitan), with their diffs applied, one
more: its MoE module imports `torchtitan/models/moe/kernels.py`, which imports triton at its
top though the tutorials' diff routes MoE through its CPU function; that file is loaded with
a stand-in `triton` (decorators only) that is gone from `sys.modules` right after, so nothing
else sees a triton. Its `main` takes the trainer class; 0.3.0's takes nothing.

`TITAN_DEVICE=cpu` (with `TORCH_DEVICE_BACKEND_AUTOLOAD=0`, so neuronlocal is not loaded) runs
the same job on plain CPU PyTorch, the reference for neuron's losses. torchtitan picks the
first available accelerator, else "cuda", and has no CPU device: here it is told "cpu", and
`torch.cpu` gets the few `torch.cuda`-style calls torchtitan makes (device index, name and
properties, memory stats, peak reset, cache release), with no memory figures (its memory
log reads -0.00GiB). The process group is gloo, torch's CPU default. Flex attention runs eagerly
there, as torch's dense reference (forward and backward through autograd): Inductor has no
flex-attention backward for CPU, so `flex_attention` refuses CPU inputs that need grad, a
check skipped here; `create_block_mask` runs eagerly too (the same mask, no C++ build).
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path
from typing import Any


def _no_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    mod = types.ModuleType(name)

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}.{attr} needs triton (CUDA expert parallelism)")
        return unavailable

    mod.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = mod


def _moe_kernels_without_triton() -> None:
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if importlib.util.find_spec("triton") is not None or spec is None or not spec.origin:
        return
    path = Path(spec.origin).parent / "models" / "moe" / "kernels.py"
    if not path.is_file():
        return  # torchtitan 0.3.0: its kernels moved (stubbed above)
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int  # type: ignore[attr-defined]
    triton.jit = lambda fn: fn  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    name = "torchtitan.models.moe.kernels"
    kernels = importlib.util.spec_from_file_location(name, path)
    assert kernels is not None and kernels.loader is not None
    mod = importlib.util.module_from_spec(kernels)
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        kernels.loader.exec_module(mod)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    sys.modules[name] = mod


def _set_timeout() -> None:
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: (  # type: ignore[attr-defined]
            dist.distributed_c10d._set_pg_timeout(timeout, group))


def _cpu_device() -> None:
    import os

    import torch
    import torch._utils

    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0":
        raise SystemExit("TITAN_DEVICE=cpu needs TORCH_DEVICE_BACKEND_AUTOLOAD=0 (plain CPU "
                         "PyTorch, no neuron backend loaded)")
    torch._utils._get_available_device_type = lambda: "cpu"
    cpu: Any = torch.cpu
    cpu.current_device = lambda: 0  # torch.cpu's is "cpu"; torchtitan passes it as an index
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None


def _eager_flex() -> None:
    import torch.nn.attention.flex_attention as flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    flex._validate_device = lambda query, key, value: None

    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask


def make_assets(root: Path) -> None:
    """`root/tests/assets/{c4_test/data.json, tokenizer/}`, deterministic."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    assets = root / "tests" / "assets"
    (assets / "c4_test").mkdir(parents=True, exist_ok=True)
    (assets / "tokenizer").mkdir(parents=True, exist_ok=True)
    docs = sorted(d for v in vars(torch.Tensor).values() if (d := getattr(v, "__doc__", None)))
    rng = random.Random(0)
    texts = [" ".join(rng.sample(docs, 3)) for _ in range(2000)]
    with open(assets / "c4_test" / "data.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(assets / "tokenizer" / "tokenizer.json"))
    (assets / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": False}))


def main() -> None:
    if sys.argv[1:2] == ["--make-assets"]:
        make_assets(Path(sys.argv[2]))
        return
    import os

    device = os.environ.get("TITAN_DEVICE", "")
    if device not in ("", "cpu"):
        raise SystemExit(f"TITAN_DEVICE={device!r}: unset (torchtitan's own choice) or 'cpu'")
    if device == "cpu":
        _cpu_device()
    _no_triton_kernels()
    _moe_kernels_without_triton()
    _set_timeout()
    import inspect

    import torchtitan.train as entry

    if device == "cpu":
        _eager_flex()
    if inspect.signature(entry.main).parameters:
        entry.main(entry.Trainer)  # type: ignore[call-arg]
    else:
        entry.main()


if __name__ == "__main__":
    main()
