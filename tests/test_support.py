"""Model support matrix and `neuronlocal check`: tiny configs, real config.json files, the
matrix runner (bad options, incremental results, memory bound) and its pages."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the support matrix needs transformers")

from neuronlocal import cli  # noqa: E402
from neuronlocal.support import configs, matrix, models, render, tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _tiny(model_type: str, arch: str, task: str = "causal-lm"):
    cfg, _ = configs.build_config(transformers.CONFIG_MAPPING[model_type], {})
    return models.build_tiny(cfg, getattr(transformers, arch), task)


# --- tiny configs -------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mixtral", "qwen2_moe", "gemma2", "opt"])
def test_shrink_makes_configs_tiny(model_type):
    cfg = tiny.shrink(transformers.CONFIG_MAPPING[model_type]())
    for name in ("hidden_size", "n_embd", "vocab_size", "num_local_experts", "num_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            assert value <= tiny.SIZES[name], (name, value)
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    assert 2 <= layers <= 4


def test_widths_that_are_a_fraction_of_the_hidden_size_stay_that_fraction():
    # MobileBERT's LM head is `hidden_size - embedding_size` wide (128 of 512 by default).
    cfg = tiny.shrink(transformers.CONFIG_MAPPING["mobilebert"]())
    assert cfg.embedding_size * 4 == cfg.true_hidden_size * 4 == cfg.hidden_size <= 64
    electra = tiny.shrink(transformers.CONFIG_MAPPING["electra"]())
    assert electra.embedding_size * 2 == electra.hidden_size


@pytest.mark.parametrize("model_type", ["mobilebert", "esm"])
def test_masked_lms_whose_default_config_did_not_build(model_type):
    # ESM's default config leaves the vocabulary (and its padding id) to the checkpoint.
    loaded = configs.load(model_type=model_type, task="masked-lm")
    cfg, model = models.build_tiny(loaded.config, loaded.model_cls, "masked-lm")
    out = model(**models.make_inputs(cfg, "masked-lm", 8, torch.Generator().manual_seed(0)))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("model_type,kinds", [
    ("qwen3_next", {"linear_attention", "full_attention"}),
    ("kimi_linear", {"linear_attention", "full_attention"}),
    ("zamba2", {"linear_attention", "hybrid"}),
    ("gemma3_text", {"sliding_attention", "full_attention"}),
])
def test_hybrid_layer_patterns_keep_one_layer_of_each_kind(model_type, kinds):
    cfg = tiny.shrink(transformers.CONFIG_MAPPING[model_type]())
    types = getattr(cfg, "layer_types", None) or cfg.layers_block_type
    assert set(types) == kinds and len(types) == cfg.num_hidden_layers <= 4


def test_hybrids_keep_attention_and_moe_layers():
    jamba = tiny.shrink(transformers.CONFIG_MAPPING["jamba"]())  # kinds follow periods
    assert {"mamba", "attention"} <= set(jamba.layers_block_type) or \
        len(set(jamba.layers_block_type)) == 2
    assert len(set(jamba.layers_num_experts)) == 2, "dense and MoE layers"
    bamba = tiny.shrink(transformers.CONFIG_MAPPING["bamba"]())  # default has no attention
    assert bamba.attn_layer_indices == [bamba.num_hidden_layers - 1]
    mixed = tiny.shrink(transformers.CONFIG_MAPPING["bailing_hybrid"]())
    assert set(mixed.mlp_layer_types) == {"dense", "sparse"}
    assert mixed.first_k_dense_replace == mixed.mlp_layer_types.count("dense")


def test_an_index_list_that_names_every_layer_is_one_kind():
    """Llama 4 lists every layer in `moe_layers` and LFM2 in `full_attn_idxs`: read as one
    value per layer, each of the 48 (32) layers would be a kind of its own and none dropped."""
    llama4 = tiny.shrink(transformers.CONFIG_MAPPING["llama4_text"]())
    assert llama4.num_hidden_layers == 2
    assert llama4.moe_layers == [0, 1]  # still every layer, remapped
    assert set(llama4.layer_types) == {"chunked_attention", "full_attention"}
    lfm2 = tiny.shrink(transformers.CONFIG_MAPPING["lfm2"](), min_layers=1)
    assert lfm2.num_hidden_layers == 1 and lfm2.full_attn_idxs == [0]
    # a per-layer value list under an index-named key still reads as values
    assert tiny._per_layer_lists({"no_rope_layers": [1, 0, 1]}, 3) == {
        "no_rope_layers": [1, 0, 1]}


def test_head_dims_stay_consistent():
    mla = tiny.shrink(transformers.CONFIG_MAPPING["deepseek_v2"]())
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert mla.num_key_value_heads == mla.num_attention_heads, "latent attention is full MHA"
    gptj = tiny.shrink(transformers.CONFIG_MAPPING["gptj"]())
    assert gptj.rotary_dim <= gptj.n_embd // gptj.n_head and gptj.rotary_dim % 2 == 0
    mamba2 = tiny.shrink(transformers.CONFIG_MAPPING["mamba2"]())
    assert mamba2.num_heads * mamba2.head_dim == mamba2.expand * mamba2.hidden_size


def test_per_layer_config_and_sub_configs():
    gemma4 = tiny.shrink(transformers.CONFIG_MAPPING["gemma4_text"]())
    heads = {c.head_dim for c in gemma4.per_layer_config}
    assert len(heads) == 2 and max(heads) <= 64, "full-attention layers keep a wider head"
    blt = tiny.shrink(configs.build_config(transformers.CONFIG_MAPPING["blt"], {})[0])
    assert blt.encoder_config.hidden_size_global == blt.global_config.hidden_size


@pytest.mark.parametrize("model_type,arch", [
    ("jamba", "JambaForCausalLM"), ("qwen3_next", "Qwen3NextForCausalLM"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"), ("gptj", "GPTJForCausalLM"),
    ("llama4", "Llama4ForCausalLM"), ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    ("musicgen", "MusicgenForCausalLM"), ("xlstm", "xLSTMForCausalLM"),
])
def test_formerly_untested_families_run_on_cpu(model_type, arch):
    cfg, model = _tiny(model_type, arch)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    inputs = models.make_inputs(cfg, "causal-lm", 8, torch.Generator().manual_seed(0))
    out = models._fwd_bwd(model, inputs)
    assert torch.isfinite(out[1])


def test_missing_optional_package_is_skipped_with_reason():
    rep = models.check_model("gemma3n", "Gemma3nForConditionalGeneration")
    assert rep.status == "skipped" and "timm" in rep.error and not rep.modes


# --- real config.json files ---------------------------------------------------------------

def _write(tmp_path: Path, raw, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


JETMOE = {"architectures": ["JetMoEForCausalLM"], "model_type": "jetmoe", "vocab_size": 32000,
          "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
          "num_key_value_heads": 16, "kv_channels": 128, "intermediate_size": 5632,
          "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
          "activation_function": "silu", "aux_loss_coef": 0.01, "bos_token_id": 1,
          "eos_token_id": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-05,
          "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.40.0"}
MPT = {"architectures": ["MPTForCausalLM"], "model_type": "mpt", "d_model": 4096, "n_heads": 32,
       "n_layers": 32, "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432,
       "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch",
                       "attn_pdrop": 0, "attn_type": "multihead_attention", "clip_qkv": None,
                       "prefix_lm": False, "qk_ln": False, "softmax_scale": None},
       "auto_map": {"AutoConfig": "configuration_mpt.MPTConfig",
                    "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"},
       "emb_pdrop": 0, "learned_pos_emb": True, "no_bias": True, "resid_pdrop": 0,
       "norm_type": "low_precision_layernorm", "use_cache": False, "torch_dtype": "bfloat16"}
LLAMA4 = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
          "boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092,
          "text_config": {"model_type": "llama4_text", "attention_chunk_size": 8192,
                          "attn_scale": 0.1, "attn_temperature_tuning": 4, "floor_scale": 8192,
                          "head_dim": 128, "hidden_size": 5120, "intermediate_size": 8192,
                          "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1,
                          "num_attention_heads": 40, "num_hidden_layers": 48,
                          "num_key_value_heads": 8, "num_local_experts": 16,
                          "num_experts_per_tok": 1, "vocab_size": 202048,
                          "max_position_embeddings": 10485760, "use_qk_norm": True,
                          "rope_theta": 500000.0, "bos_token_id": 200000,
                          "eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018},
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
EMU3_REMOTE = {"architectures": ["Emu3ForCausalLM"], "model_type": "Emu3",
               "auto_map": {"AutoConfig": "configuration_emu3.Emu3Config",
                            "AutoModelForCausalLM": "modeling_emu3.Emu3ForCausalLM"},
               "vocab_size": 184622, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 9216, "rope_theta": 1000000.0,
               "bos_token_id": 151849, "eos_token_id": 151850, "pad_token_id": 151643}


def test_unknown_architecture_uses_the_model_types_class(tmp_path):
    loaded = configs.load(config=str(_write(tmp_path, JETMOE)))
    assert loaded.architecture == "JetMoeForCausalLM"
    assert "JetMoEForCausalLM" in loaded.how and "model type 'jetmoe'" in loaded.how


def test_remote_code_config_of_a_built_in_type_uses_transformers(tmp_path):
    loaded = configs.load(config=str(_write(tmp_path, MPT)))
    assert loaded.architecture == "MptForCausalLM"
    assert any("auto_map" in n and "built in" in n for n in loaded.notes)


def test_old_field_types_are_repaired_with_a_warning(tmp_path):
    loaded = configs.load(config=str(_write(tmp_path, LLAMA4)))
    assert loaded.architecture == "Llama4ForConditionalGeneration"
    assert loaded.config.text_config.attn_temperature_tuning is True
    assert any("attn_temperature_tuning" in n for n in loaded.notes)


def test_unrepairable_field_is_named(tmp_path, capsys):
    bad = _write(tmp_path, {"model_type": "llama", "hidden_act": 7})
    assert cli.main(["check", "--config", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "hidden_act" in out and "Traceback" not in out


def test_model_type_matches_case_insensitively(tmp_path):
    loaded = configs.load(config=str(_write(tmp_path, {"model_type": "LLaMA"})))
    assert loaded.config.model_type == "llama" and "case-insensitive" in loaded.notes[0]
    assert configs.load(model_type="GPT2").architecture == "GPT2LMHeadModel"


def test_remote_code_needs_trust_and_the_code(tmp_path, capsys):
    _write(tmp_path, EMU3_REMOTE)
    assert cli.main(["check", "--model-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "--trust-remote-code" in out and "modeling_emu3.py" in out and "Traceback" not in out
    assert cli.main(["check", "--model-dir", str(tmp_path), "--trust-remote-code"]) == 2
    assert "needs configuration_emu3.py, modeling_emu3.py" in capsys.readouterr().out


def test_remote_code_runs_with_trust_from_a_local_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE",
                        str(tmp_path / "modules"), raising=False)
    code = tmp_path / "ckpt"
    code.mkdir()
    (code / "configuration_toy.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass ToyConfig(LlamaConfig):\n"
        "    model_type = 'toy_remote'\n")
    (code / "modeling_toy.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_toy import ToyConfig"
        "\n\n\nclass ToyForCausalLM(LlamaForCausalLM):\n    config_class = ToyConfig\n")
    _write(code, {"model_type": "toy_remote", "architectures": ["ToyForCausalLM"],
                  "auto_map": {"AutoConfig": "configuration_toy.ToyConfig",
                               "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"},
                  "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8})
    loaded = configs.load(model_dir=str(code), trust_remote_code=True)
    assert loaded.architecture == "ToyForCausalLM" and "remote code" in loaded.how
    rep = models.check_model("toy_remote", loaded.architecture, config=loaded.config,
                             modes=("eager",), model_cls=loaded.model_cls)
    assert rep.status == "pass", rep.error


def test_check_input_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["check", "no_such_model_type"]) == 2
    lst = _write(tmp_path, [{"model_type": "llama"}])
    assert cli.main(["check", "--config", str(lst)]) == 2
    bad = _write(tmp_path, {}, "bad.json")
    bad.write_text("{not json")
    assert cli.main(["check", "--config", str(bad)]) == 2
    assert cli.main(["check", "--model-dir", str(tmp_path / "nope")]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["check", "--model-dir", str(empty)]) == 2
    out = capsys.readouterr().out
    assert "Traceback" not in out and "internet" not in out and "repo" not in out
    assert "holds a list" in out and "no such directory" in out and "has no config.json" in out


def test_build_and_cpu_failures_are_not_blamed_on_neuron(capsys):
    assert cli.main(["check", "gemma3n"]) == 3  # needs timm: nothing could run
    out = capsys.readouterr().out
    assert "UNTESTED" in out and "NOT run on neuron" not in out
    assert cli.main(["check", "gemma4_assistant"]) == 4  # needs the target model's KV states
    out = capsys.readouterr().out
    assert "does not run on CPU either" in out and "NOT run on neuron" not in out


def test_mismatch_is_a_neuron_failure():
    rep = models.ModelReport("x", "X")
    rep.modes["eager"] = models.ModeResult(cpu_ok=True, neuron_ok=False, error="Mismatch: 1")
    rep.modes["train"] = models.ModeResult(cpu_ok=False, error="cpu: boom")
    assert models.classify(rep) == "neuron-fail" and rep.error == "Mismatch: 1"
    only_cpu_fails = models.ModelReport("y", "Y", modes={"eager": models.ModeResult()})
    assert models.classify(only_cpu_fails) == "cpu-fail"


def test_check_default_config_is_a_quiet_readable_report(fresh_python):
    """`make demo`'s check, in a fresh process: a verdict and tables, and nothing else on
    either stream: no third-party warning about inputs the check built (deprecations,
    attention masks), no warning pointing into neuronlocal or C++ sources, no Python reprs."""
    r = fresh_python("import sys\nfrom neuronlocal import cli\nsys.exit(cli.main(['check']))",
                     timeout=600)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "verdict: llama RUNS on neuron" in out and "TP=" in out
    assert "shapes" in out and "graphs compiled" in out
    assert "64-bit downcasts (Trainium computes" in out and "  aten::add.Tensor" in out
    both = out + r.stderr
    for noise in ("deprecated", "attention mask", "attention_mask", "Warning", "warning:",
                  "Triggered internally", ".cpp", ".py:", "{'", "[transformers]"):
        assert noise not in both, noise


def test_seq2seq_decoder_inputs_come_from_the_models_own_preparation():
    # FSMT does not derive decoder inputs from the labels: they come from the model's own
    # prepare_decoder_input_ids_from_labels, as transformers' seq2seq collator does.
    loaded = configs.load(model_type="fsmt", task="seq2seq")
    cfg, model = models.build_tiny(loaded.config, loaded.model_cls, "seq2seq")
    inputs = models.make_inputs(cfg, "seq2seq", 8, torch.Generator().manual_seed(0), model)
    assert torch.equal(inputs["decoder_input_ids"],
                       model.prepare_decoder_input_ids_from_labels(labels=inputs["labels"]))
    out = model(**inputs)
    assert out.logits.shape[:2] == inputs["labels"].shape and torch.isfinite(out.loss)


def test_check_estimates_a_training_step_only_for_causal_lms(capsys):
    from neuronlocal.support import check

    check._print_fit(configs.load(model_type="t5", task="seq2seq"), "seq2seq")
    out = capsys.readouterr().out
    assert "full size:" in out and "meta device" not in out
    assert "not estimated (step estimates cover causal-LM models; a seq2seq step" in out


# --- the matrix runner --------------------------------------------------------------------

def _row(mt: str, status: str, **extra) -> dict:
    return {"model_type": mt, "architecture": mt.upper(), "status": status, "modes": {},
            "seconds": 1.0, **extra}


@pytest.mark.parametrize("argv,needle", [
    (["-j", "0"], "from 1 to"), (["-j", "-1"], "from 1 to"),
    (["--timeout", "-1"], "above 0"), (["--models", "llama,no_such_model"], "no_such_model"),
    (["--models", "lama"], "did you mean"), (["--models", ""], "at least one"),
])
def test_support_rejects_bad_options_before_running(argv, needle, tmp_path, monkeypatch,
                                                    capsys):
    monkeypatch.setattr(matrix, "run_one", lambda *a, **k: pytest.fail("ran a model"))
    try:
        code = cli.main(["support", "--out", str(tmp_path), "--models", "llama", *argv])
    except SystemExit as e:  # options argparse refuses
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert needle in out and "%" not in out


def test_support_unwritable_out_fails_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(matrix, "run_one", lambda *a, **k: pytest.fail("ran a model"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert cli.main(["support", "--models", "llama", "--out", str(a_file / "sub")]) == 2
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        assert cli.main(["support", "--models", "llama", "--out", str(ro)]) == 2
    finally:
        ro.chmod(stat.S_IRWXU)
    assert "cannot write there" in capsys.readouterr().out


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    calls = []

    def fake(mt, arch, task, timeout, max_memory, threads):
        calls.append(mt)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run dies after one row
        return _row(mt, "pass", fallback_ops={"aten::mm": 2, "aten::bernoulli_": 1})

    monkeypatch.setattr(matrix, "run_one", fake)
    with pytest.raises(KeyboardInterrupt):
        matrix.run_matrix("causal-lm", tmp_path, only=["gpt2", "llama"])
    data = json.loads((tmp_path / "support-causal-lm.json").read_text())
    ran = [r for r in data["models"] if r["status"] != matrix.NOT_RUN]
    assert [r["model_type"] for r in ran] == [calls[0]] == ["llama"]  # most used first
    assert ran[0]["fallback_op_count"] == 2
    # every other architecture is listed, as not run: the denominator never shrinks
    assert len(data["models"]) == len(matrix.architectures("causal-lm"))
    assert data["summary"]["counts"]["not-run"] == len(data["models"]) - 1
    assert calls[0] in (tmp_path / "support-causal-lm.md").read_text()
    # a rerun resumes: only the missing row runs
    monkeypatch.setattr(matrix, "run_one", lambda mt, *a, **k: calls.append(mt) or _row(
        mt, "timeout"))
    data = matrix.run_matrix("causal-lm", tmp_path, only=["gpt2", "llama"])
    assert calls[-1] != calls[0]
    counts = data["summary"]["counts"]
    assert (counts["pass"], counts["timeout"]) == (1, 1)
    assert counts["not-run"] == len(data["models"]) - 2


def test_rows_run_most_used_first_then_longest_first():
    archs = [("zamba", "Z"), ("llama", "L"), ("cohere", "C"), ("afmoe", "A"), ("gpt2", "G")]
    took = {"zamba": 60.0, "cohere": 5.0, "llama": 1.0, "gpt2": 9.0}
    assert [mt for mt, _ in matrix.run_order(archs, took)] == [
        "llama", "gpt2", "zamba", "cohere", "afmoe"]


def test_rerunning_chosen_rows_keeps_the_sweeps_run_record(tmp_path, monkeypatch):
    """The JSON's `run` says how the whole sweep ran: a resumed sweep adds to it, a rerun of
    chosen rows is listed beside it and never replaces it."""
    monkeypatch.setattr(matrix, "architectures",
                        lambda task: [("a", "A"), ("b", "B"), ("c", "C")])
    ran = []
    monkeypatch.setattr(matrix, "run_one",
                        lambda mt, *a, **k: ran.append(mt) or _row(mt, "pass"))
    path = tmp_path / "support-causal-lm.json"
    matrix.run_matrix("causal-lm", tmp_path, jobs=2, only=["a"])
    first = json.loads(path.read_text())["run"]
    assert first["reruns"][0]["models"] == ["a"] and "rows_run" not in first
    matrix.run_matrix("causal-lm", tmp_path, jobs=2)  # the sweep (resumes: b and c)
    sweep = json.loads(path.read_text())["run"]
    assert sweep["rows_run"] == 2 and sweep["jobs"] == 2
    matrix.run_matrix("causal-lm", tmp_path, jobs=1, only=["b"], force=True)
    run = json.loads(path.read_text())["run"]
    assert run["jobs"] == 2 and run["rows_run"] == 2  # still the sweep's
    assert [r["models"] for r in run["reruns"]] == [["a"], ["b"]]
    assert run["reruns"][-1]["jobs"] == 1
    assert "rerun since: a, b" in (tmp_path / "support-causal-lm.md").read_text()
    matrix.run_matrix("causal-lm", tmp_path, jobs=2, force=True)  # a new sweep
    run = json.loads(path.read_text())["run"]
    assert run["rows_run"] == 3 and "reruns" not in run
    assert ran == ["a", "b", "c", "b", "a", "b", "c"]


def test_one_number_everywhere(tmp_path):
    rows = {"a": _row("a", "pass", fallback_ops={"aten::mm": 1}), "b": _row("b", "neuron-fail"),
            "c": _row("c", "build-fail", error="build: boom"), "d": _row("d", "cpu-fail")}
    data = matrix.save(tmp_path / "support-causal-lm.json", "causal-lm", rows)
    render.write_all(tmp_path, "causal-lm", data)
    s = data["summary"]
    assert (s["tested"], s["untested"], s["passed"]) == (2, 2, 1)
    assert s["pass_rate_of_tested"] == 0.5
    line = render.headline(data)
    assert "2 tested" in line and "50.0%" in line and "2 untested" in line
    md = (tmp_path / "support-causal-lm.md").read_text()
    page = (tmp_path / "support-causal-lm.html").read_text()
    assert line in md and line.replace("'", "&#x27;") in page
    assert "<svg" in page and "fallback ops" in page and "fallback ops" in md
    assert "Untested architectures" in md and "build: boom" in page


def test_readme_states_the_committed_json_numbers():
    """README's support block is generated from docs/support/*.json (tools/support_matrix.py
    --readme): the same counts as the HTML and markdown pages."""
    readme = (ROOT / "README.md").read_text()
    block = render.readme_block(ROOT / "docs" / "support", ROOT)
    assert block in readme, "run `python tools/support_matrix.py --readme`"
    for path in (ROOT / "docs" / "support").glob("support-*.json"):
        data = json.loads(path.read_text())
        assert render.headline(data) in path.with_suffix(".md").read_text()
        assert data["summary"] == matrix.summary(data["models"]), "summary is derived"


def test_worker_timeout_and_memory_bound_are_rows():
    row = matrix.run_one("llama", "LlamaForCausalLM", "causal-lm", timeout=0.5)
    assert row["status"] == "timeout"
    # The row's environment (optimisation level, fallback policy) is set in the row's own
    # process, never in the caller's.
    assert "NEURON_CC_FLAGS" not in os.environ
    assert "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION" not in os.environ
    row = matrix.run_one("llama", "LlamaForCausalLM", "causal-lm", timeout=300,
                         max_memory=64 * 2**20)
    assert row["status"] == "skipped" and "peak" in row["error"] and row["peak_rss"] > 0


def test_a_timed_out_row_keeps_the_modes_it_finished(tmp_path):
    """check_model reports after each mode; a row cut short by its timeout keeps those modes
    and names the one still running, so a slow architecture still gets part of an answer."""
    seen: list[list[str]] = []
    rep = models.check_model("llama", "LlamaForCausalLM", modes=("eager", "train"),
                             progress=lambda r: seen.append(list(r.modes)))
    assert seen == [["eager"], ["eager", "train"]] and rep.status == "pass"
    result = tmp_path / "row.json"
    partial = {**rep.as_dict(), "modes": {"eager": rep.as_dict()["modes"]["eager"]}}
    (tmp_path / "row.json.partial").write_text(json.dumps(partial))
    base = {"model_type": "llama", "architecture": "LlamaForCausalLM", "modes": {}}
    row = matrix._timed_out(base, "causal-lm", result, 600, 601.0, 1)
    assert row["status"] == "timeout" and list(row["modes"]) == ["eager"]
    assert row["error"] == ("no result within 600s: mode compile still running "
                            "(finished: eager pass)")
    row = matrix._timed_out(base, "causal-lm", tmp_path / "none.json", 600, 601.0, 1)
    assert row["modes"] == {} and row["error"] == "no result within 600s: mode eager still running"


@pytest.mark.slow
def test_ci_subset(tmp_path):
    data = matrix.run_matrix("causal-lm", tmp_path, jobs=2, only=matrix.CI_SUBSET)
    assert data["summary"]["counts"].get("neuron-fail", 0) == 0, data["summary"]


class _Weights(torch.nn.Module):
    """A model of `n` bf16-sized parameters (built on meta by memory_fit)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n))


@pytest.mark.parametrize(("lnc", "infer", "train"), [
    (2, {"trn2.3xlarge": 2, "trn2.48xlarge": 2}, {"trn2.3xlarge": None, "trn2.48xlarge": 16}),
    (1, {"trn2.3xlarge": 4, "trn2.48xlarge": 4}, {"trn2.3xlarge": None, "trn2.48xlarge": 32}),
])
def test_memory_fit_counts_cores_and_hbm_of_the_lnc(monkeypatch, lnc, infer, train):
    """20 Gi parameters: 40 GiB of bf16 weights, 320 GiB of training state. LNC=2 gives
    24 GiB cores (4 per trn2.3xlarge, 64 per trn2.48xlarge), LNC=1 12 GiB cores (8, 128)."""
    import dataclasses

    from neuronlocal.core import state
    from neuronlocal.support.check import memory_fit

    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, lnc=lnc))
    fit = memory_fit(20 * 2**30, _Weights)
    assert (fit.infer_tp, fit.train_tp) == (infer, train)


def test_a_row_forked_from_the_warmed_forkserver_runs_every_mode():
    """Rows fork from a forkserver that warmed Inductor (support/preload.py). Anything there
    that started autograd's threads would make every backward in the rows fail on CPU as
    well, which the verdict does not hold against neuron: every mode must really run."""
    row = matrix.run_one("llama", "LlamaForCausalLM", "causal-lm", timeout=300)
    assert row["status"] == "pass", row.get("error")
    assert list(row["modes"]) == list(models.TASK_MODES["causal-lm"])
    for mode, m in row["modes"].items():
        assert m["cpu_ok"] and m["neuron_ok"], (mode, m["error"])
    assert row["modes"]["compile"]["graphs"] == row["modes"]["shapes"]["graphs"] == 1


def test_the_shapes_mode_recompiles_the_compiled_model_with_symbolic_sizes():
    """compile runs the compiled model at its first size (a static graph); shapes runs the
    same model at the second size, where Dynamo recompiles with symbolic sizes and the
    backend specialises the graph, as in a job whose sequence length changes. Alone, shapes
    meets the first size itself, so what it tests does not depend on the other mode."""
    from neuronlocal.core import dynamo_metrics

    for modes in (("compile", "shapes"), ("shapes",)):
        rep = models.check_model("llama", "LlamaForCausalLM", modes=modes)
        assert rep.status == "pass", rep.error
        graphs = dynamo_metrics.get_dynamo_metrics()["graphs"]
        assert [g["kind"] for g in graphs] == ["static", "specialized"], modes
        assert graphs[1]["input_shapes"] != graphs[0]["input_shapes"]
        assert rep.modes["shapes"].graphs == (1 if "compile" in modes else 2)


def test_random_ops_in_a_forward_compare_with_cpu():
    """Reformer's LSH attention draws random rotations in every forward. The tiny config fixes
    its hash seed and compiled graphs draw from the eager generator (fallback_random), so CPU
    and neuron see the same rotations in eager and compiled modes; without either, both
    modes differed by ~1e-2 and the row blamed neuron."""
    rep = models.check_model("reformer", "ReformerModelWithLMHead", modes=("eager", "compile"))
    assert rep.status == "pass", rep.error
    assert rep.modes["eager"].max_diff == 0.0
    assert rep.modes["compile"].max_diff is not None and rep.modes["compile"].max_diff < 1e-5


def test_results_and_pages_never_follow_a_planted_symlink(tmp_path):
    """matrix.save and the pages replace a link planted at any name they use (the JSON, its
    temporary, the markdown, the HTML) instead of writing through it."""
    from neuronlocal.support import render as support_render

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    names = ["support-causal-lm.json", "support-causal-lm.tmp", "support-causal-lm.md",
             "support-causal-lm.html"]
    for name in names:
        (out / name).symlink_to(victim)
    data = matrix.save(out / "support-causal-lm.json", "causal-lm", {"llama": _row("llama",
                                                                                   "pass")})
    support_render.write_all(out, "causal-lm", data)
    assert victim.read_text() == "keep me"
    for name in ("support-causal-lm.json", "support-causal-lm.md", "support-causal-lm.html"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0, name
    assert json.loads((out / "support-causal-lm.json").read_text())["models"][0]["status"] == \
        "pass"


def test_a_damaged_results_file_is_kept_aside_and_said_so(tmp_path, capsys):
    path = tmp_path / "support-causal-lm.json"
    matrix.save(path, "causal-lm", {"llama": _row("llama", "pass"), "gpt2": _row("gpt2", "pass")})
    good = path.read_text()
    path.write_text(good[:40] + "\x00" + good[40:])  # one stray byte
    assert matrix.load(path) == {}
    err = capsys.readouterr().err
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(path.name + ".damaged-")]
    assert len(aside) == 1 and aside[0].read_text() == good[:40] + "\x00" + good[40:]
    assert f"{path} is damaged" in err and str(aside[0]) in err and "\n" not in err.strip()
    matrix.save(path, "causal-lm", {})  # the next save leaves the damaged rows where they are
    assert len(json.loads(aside[0].read_text().replace("\x00", ""))["models"]) == 2
    assert matrix.load(path) == {} and capsys.readouterr().err == ""


def _mode(cpu_ok: bool = True, neuron_ok: bool = True, error: str | None = None) -> dict:
    return {"cpu_ok": cpu_ok, "neuron_ok": neuron_ok, "error": error, "graphs": 1}


def _wide_matrix(tmp_path: Path) -> dict:
    unsupported = "unsupported: model does not support a static cache"
    long_error = "neuron: RuntimeError: " + "shape mismatch in a very long message " * 40
    rows = {f"m{i}": _row(f"qwen3_omni_moe_thinker_{i}", "pass",
                          architecture="Qwen3OmniMoeThinkerForConditionalGeneration",
                          fallback_ops={f"aten::op_number_{k}.out": 1 for k in range(6)},
                          modes={"eager": _mode(), "generate": _mode(False, False, unsupported)})
            for i in range(30)}
    rows["bad"] = _row("bad", "neuron-fail", modes={"generate": _mode(False, False, unsupported),
                                                    "compile": _mode(True, False, long_error)})
    return matrix.save(tmp_path / "support-causal-lm.json", "causal-lm", rows)


def test_pass_rows_show_no_error_and_failures_show_the_failing_mode(tmp_path):
    data = _wide_matrix(tmp_path)
    page, md = render.html_page(data), render.markdown(data)
    assert "unsupported" not in md  # n/a is not an error: no row shows it
    assert page.count('title="model does not support a static cache"') == 31  # on the n/a cell
    bad = next(r for r in data["models"] if r["status"] == "neuron-fail")
    assert render._error(bad).startswith("neuron: RuntimeError")
    assert "<details><summary>neuron: RuntimeError" in page  # folded to one line


def test_committed_pages_are_the_renderers_output():
    """docs/support/*.html and *.md are rendered from their JSON by the current renderer
    (regenerate: render.write_all for each JSON, as tools/support_matrix.py does)."""
    for path in (ROOT / "docs" / "support").glob("support-*.json"):
        data = json.loads(path.read_text())
        assert path.with_suffix(".html").read_text() == render.html_page(data), path
        assert path.with_suffix(".md").read_text() == render.markdown(data), path


def test_support_page_fits_a_wide_window(tmp_path):
    """Headless Chromium at 1400 px, on the committed causal-lm matrix (the longest) and a
    synthetic one with long names, fallback lists and errors: the table fits (nothing
    wider than the window, with every <details> open too), no cell is a wall of text; at
    700 px the table scrolls in its box, never the page."""
    from conftest import page_layout

    committed = json.loads((ROOT / "docs" / "support" / "support-causal-lm.json").read_text())
    for page in (render.html_page(committed), render.html_page(_wide_matrix(tmp_path))):
        layout = page_layout(page, tmp_path)
        for state in ("shown", "opened"):
            assert layout[state]["over"] == [], (state, layout[state])
        assert layout["shown"]["tallest_cell"] < 120, layout["shown"]
        narrow = page_layout(page, tmp_path, width=700)["shown"]
        assert narrow["scroll"] <= narrow["viewport"], narrow


def test_check_recommends_only_tp_degrees_the_model_allows():
    """Qwen2.5-7B's shape (28 query heads, 4 key/value heads): TP=8 would split heads, so
    the check offers 1, 2 and 4; training fits as TP=4 x FSDP=16 on a trn2.48xlarge, and
    applying that layout is an estimate that fits (not "cannot estimate")."""
    transformers = pytest.importorskip("transformers")
    from neuronlocal.estimate import cli as estimate_cli
    from neuronlocal.estimate import estimate
    from neuronlocal.estimate.layout import Layout, problems
    from neuronlocal.estimate.workload import shape
    from neuronlocal.support.check import memory_fit

    cfg = transformers.Qwen2Config(hidden_size=3584, intermediate_size=18944,
                                   num_attention_heads=28, num_hidden_layers=28,
                                   num_key_value_heads=4, vocab_size=152064,
                                   max_position_embeddings=32768)
    fit = memory_fit(cfg, transformers.Qwen2ForCausalLM)
    assert fit.degrees == (1, 2, 4)
    tp, fsdp = fit.train_tp["trn2.48xlarge"], fit.train_fsdp["trn2.48xlarge"]
    assert (tp, fsdp) == (4, 16) and fit.infer_tp["trn2.48xlarge"] in fit.degrees
    lay = Layout("trn2.48xlarge", "train", tp=tp, dp=fsdp, seq=4096, zero=3)
    assert problems(lay, shape(cfg, 0)) == []
    assert estimate(cfg, lay).fits
    line = estimate_cli.check_line(cfg, tp, fsdp=True)
    assert "TP=4 x FSDP=16" in line and "not estimated" not in line
