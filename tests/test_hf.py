"""Hugging Face libraries on `neuron`: transformers, accelerate, PEFT, TRL, diffusers.

Each test compares with the same run on plain CPU. Tiny random models built from configs; no
downloads. Multi-process runs (accelerate launch, torchrun TP, TP x FSDP) and compiled runs are
in subprocesses; the long ones are marked slow.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _cfg(layers: int = 2, vocab: int = 128):  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_cfg(layers=4)).save_pretrained(d, max_shard_size="100KB")
    return d


def _run(args: list[str], timeout: int, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and "neuron" in dist.Backend.backend_list


needs_dist = pytest.mark.skipif(not _distributed_ready(),
                                reason="c10d backend 'neuron' is not registered")


# ---------------------------------------------------------------- transformers


def test_detection() -> None:
    from transformers.utils import is_torch_neuron_available

    assert is_torch_neuron_available() and is_torch_neuron_available(check_device=True)


@pytest.mark.parametrize("async_load", ["0", "1"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_from_pretrained_device_map_neuron(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                           async_load: str, dtype: torch.dtype | None) -> None:
    """Threaded and single-threaded weight loading both land every tensor on the core, exactly."""
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", async_load)
    cpu = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=dtype)
    dev = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, device_map="neuron",
                                                            dtype=dtype)
    ref = cpu.state_dict()
    for k, v in dev.state_dict().items():
        assert v.device == torch.device("neuron", 0), k
        assert torch.equal(v.cpu(), ref[k]), k


@pytest.mark.parametrize("async_load", ["0", "1"])
def test_from_pretrained_other_core(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                    async_load: str) -> None:
    """Loader threads must place weights on the requested core, not the thread's current one."""
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", async_load)
    # an earlier test's model (HF models hold reference cycles) freed by the collector
    # during this load would shrink the delta measured below
    gc.collect()
    before = torch.neuron.memory_allocated(2)
    dev = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, device_map="neuron:2")
    assert {p.device for p in dev.parameters()} == {torch.device("neuron", 2)}
    size = sum(p.numel() * p.element_size() for p in dev.parameters())
    assert torch.neuron.memory_allocated(2) - before >= size


def test_device_map_auto_spreads_over_cores(tiny_dir: Path) -> None:
    cpu = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    dev = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, device_map="auto")
    cores = set(dev.hf_device_map.values())
    assert "cpu" not in cores and len(cores) > 1, dev.hf_device_map
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = cpu.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(dev.generate(ids.to("neuron"), max_new_tokens=6, do_sample=False).cpu(),
                       ref)


def test_device_map_auto_respects_max_memory(tiny_dir: Path) -> None:
    dev = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, device_map="auto", max_memory={0: "60KB", 1: "200KB", 3: "10MB"})
    assert set(dev.hf_device_map.values()) <= {0, 1, 3}
    assert 3 in dev.hf_device_map.values()


def test_max_memory_bad_core_is_a_clear_error() -> None:
    from accelerate.utils import get_max_memory

    with pytest.raises(ValueError, match="neuron core"):
        get_max_memory({99: "1GB"})


def test_save_pretrained_roundtrip(tmp_path: Path, tiny_dir: Path) -> None:
    dev = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, device_map="neuron")
    dev.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="neuron:1")
    for (k, a), b in zip(dev.state_dict().items(), back.state_dict().values(), strict=True):
        assert b.device == torch.device("neuron", 1) and torch.equal(a.cpu(), b.cpu()), k


def test_generate_static_cache_compiled_matches_cpu() -> None:
    """transformers auto-compiles the decode step on backend 'neuron'; greedy output == CPU."""
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(_cfg()).eval()
    dev = transformers.LlamaForCausalLM(_cfg()).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to("neuron")
    assert dev._default_compile_config().backend == "neuron"
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False,
              cache_implementation="static")
    ref = cpu.generate(ids, **kw)
    n0 = torch.neuron.get_dynamo_metrics()["num_graphs"]
    out = dev.generate(ids.to("neuron"), **kw)
    n1 = torch.neuron.get_dynamo_metrics()["num_graphs"]
    assert n1 > n0, "generate() did not compile on backend neuron"
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(dev.generate(ids.to("neuron"), **kw).cpu(), ref)
    assert torch.neuron.get_dynamo_metrics()["num_graphs"] == n1, "recompiled after warm-up"


def test_compiled_decode_attends_on_the_key_value_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grouped-query decode step folds the query heads instead of repeating the cache
    (as eager SDPA does); greedy output still equals CPU's."""
    from neuronlocal.compile import aot

    folded: list[bool] = []
    real = aot._packed_gqa
    monkeypatch.setattr(aot, "_packed_gqa", lambda gm: folded.append(real(gm)) or folded[-1])
    torch._dynamo.reset()
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(_cfg()).eval()
    dev = transformers.LlamaForCausalLM(_cfg()).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to("neuron")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(dev.generate(ids.to("neuron"), **kw).cpu(), cpu.generate(ids, **kw))
    assert True in folded


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def _trainer_losses(use_cpu: bool, compile_: bool, tmp: Path) -> tuple[list[float], str]:
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=use_cpu, torch_compile=compile_,
        save_strategy="no", seed=0, disable_tqdm=True, train_sampling_strategy="sequential")
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(_cfg()), args=args,
                                   train_dataset=_Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, str(args.device)


def test_trainer_on_neuron(tmp_path: Path) -> None:
    ref, dev_cpu = _trainer_losses(True, False, tmp_path)
    got, dev = _trainer_losses(False, False, tmp_path)
    assert dev_cpu == "cpu" and dev == "neuron:0"
    assert got == pytest.approx(ref, abs=1e-4)


@pytest.mark.slow
def test_trainer_torch_compile_backend_neuron(tmp_path: Path) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile=True,
                                          report_to=[])
    assert args.torch_compile_backend == "neuron"
    ref, _ = _trainer_losses(True, False, tmp_path)
    n0 = torch.neuron.get_dynamo_metrics()["num_graphs"]
    got, _ = _trainer_losses(False, True, tmp_path)
    assert torch.neuron.get_dynamo_metrics()["num_graphs"] > n0
    assert got == pytest.approx(ref, abs=1e-3)


TP_SCRIPT = """
import os, sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto")
w = m.model.layers[0].self_attn.q_proj.weight
assert type(w).__name__ == "DTensor" and w.to_local().shape[0] == w.shape[0] // 2
assert torch.distributed.get_backend() == "neuron" and m.device.type == "neuron"
ids = torch.arange(8).view(1, 8)
ref = AutoModelForCausalLM.from_pretrained(sys.argv[1]).generate(ids, max_new_tokens=6,
                                                                  do_sample=False)
out = m.generate(ids.to(m.device), max_new_tokens=6, do_sample=False)
assert torch.equal(out.cpu(), ref), (out, ref)
print("ok", os.environ["RANK"], m.device)
"""


@needs_dist
def test_tp_plan_torchrun(tmp_path: Path, tiny_dir: Path) -> None:
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                str(script), str(tiny_dir)], timeout=300)
    assert out.stdout.count("ok") == 2


# ---------------------------------------------------------------- accelerate


def test_accelerator_single_process_bf16() -> None:
    code = """
import torch
from accelerate import Accelerator
a = Accelerator(mixed_precision="bf16")
assert a.device.type == "neuron" and a.native_amp, (a.device, a.native_amp)
m, opt = a.prepare(torch.nn.Linear(8, 8), torch.optim.SGD(torch.nn.Linear(8, 8).parameters(), 0.1))
assert next(m.parameters()).device.type == "neuron"
seen = []
m.register_forward_pre_hook(lambda mod, i: seen.append(torch.get_autocast_dtype("neuron")))
with a.autocast():
    y = torch.ones(2, 8, device=a.device) @ torch.ones(8, 8, device=a.device)
assert y.dtype == torch.bfloat16
m(torch.ones(2, 8, device=a.device))
print("ok", a.device, a.distributed_type)
"""
    out = _run([sys.executable, "-c", code], timeout=120)
    assert "ok neuron" in out.stdout


ACCEL_SCRIPT = """
import torch
from accelerate import Accelerator
a = Accelerator(mixed_precision="bf16")
assert a.state.backend == "neuron" and a.device == torch.device("neuron", a.process_index)
torch.manual_seed(0)
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
m, opt = a.prepare(m, opt)
x = torch.ones(4, 8, device=a.device) * (a.process_index + 1)
with a.autocast():
    loss = m(x).float().sum()
a.backward(loss); opt.step()
g = a.gather(torch.tensor([a.process_index], device=a.device))
# 1-D: the neuron backend rejects a flat output for a multi-dim input (see report)
w = a.gather(a.unwrap_model(m).weight.detach().flatten()).view(a.num_processes, -1)
assert g.tolist() == list(range(a.num_processes)) and torch.equal(w[0], w[-1])
print("ok", a.process_index, a.distributed_type)
"""


@needs_dist
def test_accelerate_launch_multi_process(tmp_path: Path) -> None:
    script = tmp_path / "acc.py"
    script.write_text(ACCEL_SCRIPT)
    out = _run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                str(script)], timeout=300)
    assert out.stdout.count("MULTI_NEURON") == 2, out.stdout


# ---------------------------------------------------------------- PEFT, TRL, diffusers


def test_lora_peft_matches_cpu() -> None:
    pytest.importorskip("peft")
    out = _run([sys.executable, str(EXAMPLES / "lora_peft.py"), "--steps", "3"], timeout=300)
    assert "max |neuron - cpu|" in out.stdout


def test_sft_trl_single_process(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    res = tmp_path / "losses.json"
    _run([sys.executable, str(EXAMPLES / "sft_trl.py"), "--steps", "3", "--json", str(res)],
         timeout=300)
    losses = json.loads(res.read_text())
    assert losses["neuron"] == pytest.approx(losses["cpu"], abs=5e-3)


@pytest.mark.slow
@needs_dist
def test_sft_trl_tp2_fsdp2() -> None:
    pytest.importorskip("trl")
    out = _run(["bash", str(EXAMPLES / "tp_fsdp_sft.sh")], timeout=600)
    assert "max |loss diff|" in out.stdout


def test_diffusers_pipeline_eager() -> None:
    pytest.importorskip("diffusers")
    out = _run([sys.executable, str(EXAMPLES / "diffusers_pipeline.py"), "--steps", "3"],
               timeout=300)
    assert "eager on neuron:0" in out.stdout


@pytest.mark.slow
def test_diffusers_pipeline_compiled() -> None:
    pytest.importorskip("diffusers")
    out = _run([sys.executable, str(EXAMPLES / "diffusers_pipeline.py"), "--steps", "3",
                "--compile"], timeout=600)
    assert "compiled (backend neuron" in out.stdout


@pytest.mark.slow
def test_example_generate_static_cache() -> None:
    out = _run([sys.executable, str(EXAMPLES / "generate_static_cache.py"), "--new-tokens", "16"],
               timeout=600)
    assert "tokens match CPU: True" in out.stdout and "after warm-up 0" in out.stdout


# ---------------------------------------------------------------- our glue


def test_generate_around_compiled_model_and_weight_loads_are_counted(tiny_dir: Path) -> None:
    """generate() calls the model's own forward: after torch.compile(model) it compiles
    nothing. The first such generate() of a model is counted (the run report says so)."""
    from neuronlocal.core import counters

    def count(name: str) -> int:
        return counters.user_counters().get(name, 0)

    loads = count("hf_weight_loads")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).to("neuron").eval()
    assert count("hf_weight_loads") == loads + 1
    ids = torch.tensor([[1, 2, 3]], device="neuron")
    before = count("hf_generate_bypassed_compile")
    model.generate(ids, max_new_tokens=2, do_sample=False)  # no wrapper: nothing to say
    assert count("hf_generate_bypassed_compile") == before
    other = transformers.LlamaForCausalLM(_cfg()).eval()
    compiled = torch.compile(other, backend="neuron")
    compiled.generate(ids.cpu(), max_new_tokens=2, do_sample=False)  # CPU: not neuron's cost
    assert count("hf_generate_bypassed_compile") == before
    other.to("neuron")
    out = compiled.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5) and count("hf_generate_bypassed_compile") == before + 1
    compiled.generate(ids, max_new_tokens=2, do_sample=False)  # once per model
    assert count("hf_generate_bypassed_compile") == before + 1


def test_hf_glue_is_lazy_and_documented() -> None:
    code = """
import sys, torch, neuronlocal.hf as hf
assert not {"transformers", "accelerate", "peft", "trl", "diffusers"} & set(sys.modules)
assert hf.applied() == []
import accelerate.utils.modeling as m
assert "accelerate.utils.modeling" in hf.applied() and m.get_max_memory._neuronlocal
print("ok")
"""
    assert "ok" in _run([sys.executable, "-c", code], timeout=120).stdout
    import neuronlocal.hf as hf

    for name in hf.PATCHES:
        assert name in (hf.__doc__ or ""), f"patch {name} is not documented in neuronlocal.hf"


@pytest.mark.parametrize("arch,wrap,compiler", [
    ("Llama", False, "eager"), pytest.param("Qwen2", True, "eager", marks=pytest.mark.slow),
    pytest.param("Llama", False, "inductor", marks=pytest.mark.slow)])
def test_flex_attention_with_grads(arch: str, wrap: bool, compiler: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' test_flex_attention_with_grads on neuron, checked against CPU: a model
    with attn_implementation="flex_attention" (transformers compiles FlexAttention and its
    block mask; Qwen2 is also compiled whole), a padded batch, loss.backward(). The CPU
    reference runs SDPA (PyTorch's FlexAttention has no CPU backward). With Inductor the
    padding mask's mask_mod body is copied to CPU with its graph."""
    import copy

    import torch_neuronx

    monkeypatch.setenv("NEURONLOCAL_COMPILER", compiler)
    torch._dynamo.reset()  # transformers compiles FlexAttention once per process
    torch.neuron.reset_dynamo_metrics()
    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cls = getattr(transformers, f"{arch}ForCausalLM")
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation="flex_attention")
    model.load_state_dict(ref.state_dict())
    model.to("neuron").train()
    ref.train()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the padded queries see no key
    labels = ids.masked_fill(mask == 0, -100)
    run = torch.compile(model, backend="neuron") if wrap else model
    torch_neuronx.clear_op_tracking()
    out = run(input_ids=ids.to("neuron"), attention_mask=mask.to("neuron"),
              labels=labels.to("neuron"))
    out.loss.backward()
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    torch.testing.assert_close(out.loss.cpu(), want.loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4, msg=name)
    graphs = torch.neuron.get_dynamo_metrics()["graphs"]
    assert graphs and {g["extra"]["compiler"] for g in graphs} == {compiler}
    if compiler == "eager":  # attention's matmuls ran on neuron, op by op
        assert "aten::bmm" in torch_neuronx.get_executed_ops()
