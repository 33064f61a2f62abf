"""The announcement's recipes, written as users write them, run under `neuronlocal run --report`.

Each script in tests/recipes/ runs once on neuron under the run report and once on plain
CPU; the test compares the results and checks the report's key facts (exit status, what
compiled, what fell back). Library defaults stay on: use_cache, TRL's gradient checkpointing
and bf16, the default torch.compile backend. All are slow (compiles, several processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
RECIPES = Path(__file__).resolve().parent / "recipes"
TEXTS = [f"the quick brown fox {i} jumps over the lazy dog {i % 7}" for i in range(32)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer, saved as a user's checkpoint is."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("recipe_llama")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _run(args: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def _report(out: Path, script: str, *args: str, torchrun: int = 0) -> dict[str, Any]:
    """Runs a recipe on neuron under `neuronlocal run --report`; returns report.json."""
    run = ["-m", "neuronlocal", "run", "--report", str(out / "report"),
           str(RECIPES / script), *args]
    if torchrun:
        run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(torchrun), *run]
    _run([sys.executable, *run])
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["complete"] and report["exit_code"] == 0
    return report


def _graphs(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for r in report["ranks"] for g in r["graphs"]]


def test_generate_static_cache_compiled_forward(model_dir: Path, tmp_path: Path) -> None:
    report = _report(tmp_path, "generate_static.py", str(model_dir), "--device", "neuron",
                     "--out", str(tmp_path / "neuron.json"))
    _run([sys.executable, str(RECIPES / "generate_static.py"), str(model_dir), "--device", "cpu",
          "--no-compile", "--out", str(tmp_path / "cpu.json")])
    got = json.loads((tmp_path / "neuron.json").read_text())
    assert got == json.loads((tmp_path / "cpu.json").read_text())
    graphs = _graphs(report)
    assert graphs and all(g["cache"] in ("hit", "miss") for g in graphs)
    # Two prompt lengths with a static cache sized prompt + 4: more than one graph compiles.
    assert len(graphs) >= 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_trl_sft_with_trl_defaults(model_dir: Path, tmp_path: Path, compiled: bool) -> None:
    flags = [] if compiled else ["--no-compile"]
    report = _report(tmp_path, "sft.py", str(model_dir), "--out", str(tmp_path / "neuron.json"),
                     *flags)
    _run([sys.executable, str(RECIPES / "sft.py"), str(model_dir), "--cpu", "--no-compile",
          "--out", str(tmp_path / "cpu.json")])
    got = json.loads((tmp_path / "neuron.json").read_text())
    ref = json.loads((tmp_path / "cpu.json").read_text())
    assert got["device"].startswith("neuron") and len(got["losses"]) == 3
    # bf16 autocast follows CUDA's op lists on neuron and CPU's own lists on CPU.
    assert got["losses"] == pytest.approx(ref["losses"], rel=3e-2)
    assert bool(_graphs(report)) == compiled


def test_torchrun_tp_fsdp_compiled_with_model_defaults(model_dir: Path, tmp_path: Path
                                                        ) -> None:
    (tmp_path / "neuron").mkdir()
    (tmp_path / "cpu").mkdir()
    report = _report(tmp_path, "tp_fsdp.py", str(model_dir), "--device", "neuron", "--out",
                     str(tmp_path / "neuron"), torchrun=4)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
          "4", str(RECIPES / "tp_fsdp.py"), str(model_dir), "--device", "cpu", "--no-compile",
          "--out", str(tmp_path / "cpu")])
    for rank in range(4):
        got = json.loads((tmp_path / "neuron" / f"rank{rank}.json").read_text())
        ref = json.loads((tmp_path / "cpu" / f"rank{rank}.json").read_text())
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4), rank
        assert got["param_norm"] == pytest.approx(ref["param_norm"], abs=1e-4), rank
    assert report["world_size"] == 4 and len(report["ranks"]) == 4
    for r in report["ranks"]:
        assert r["graphs"] and r["collectives"], r["rank"]


def test_peft_lora(model_dir: Path, tmp_path: Path) -> None:
    report = _report(tmp_path, "lora.py", str(model_dir), "--device", "neuron", "--out",
                     str(tmp_path / "neuron.json"))
    _run([sys.executable, str(RECIPES / "lora.py"), str(model_dir), "--device", "cpu", "--out",
          str(tmp_path / "cpu.json")])
    got = json.loads((tmp_path / "neuron.json").read_text())
    ref = json.loads((tmp_path / "cpu.json").read_text())
    assert got["trainable"] == ref["trainable"] > 0
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4)
    assert report["ranks"][0]["memory"][0]["peak_bytes"] > 0


def test_diffusers_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    report = _report(tmp_path, "diffusion.py", "--device", "neuron", "--out",
                     str(tmp_path / "neuron.json"))
    _run([sys.executable, str(RECIPES / "diffusion.py"), "--device", "cpu", "--out",
          str(tmp_path / "cpu.json")])
    got = json.loads((tmp_path / "neuron.json").read_text())["image"]
    ref = json.loads((tmp_path / "cpu.json").read_text())["image"]
    assert max(abs(x - y) for x, y in zip(got, ref, strict=True)) < 1e-4
    assert report["ranks"][0]["eager_ops"]
