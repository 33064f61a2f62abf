"""Model support matrix and `neuronlocal check`."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers", reason="the support matrix needs transformers")

from neuronlocal import cli  # noqa: E402
from neuronlocal.support import matrix, models, render  # noqa: E402


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mixtral", "qwen2_moe", "gemma2", "opt"])
def test_shrink_makes_configs_tiny(model_type):
    cfg = models.shrink(transformers.CONFIG_MAPPING[model_type]())
    for name in ("hidden_size", "n_embd", "num_hidden_layers", "n_layer", "vocab_size",
                 "num_local_experts", "num_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            assert value <= models._SIZES[name], (name, value)


def test_check_model_llama_all_modes():
    rep = models.check_model("llama", "LlamaForCausalLM")
    assert rep.status == "pass", rep.error
    assert set(rep.modes) == set(models.MODES)
    assert all(m.cpu_ok and m.neuron_ok for m in rep.modes.values())
    assert rep.peak_hbm > 0 and rep.compiles >= 1


def test_mismatch_is_a_neuron_failure():
    rep = models.ModelReport("x", "X")
    rep.modes["eager"] = models.ModeResult(cpu_ok=True, neuron_ok=False, error="Mismatch: 1")
    rep.modes["train"] = models.ModeResult(cpu_ok=False, error="cpu: boom")
    assert models.classify(rep) == "neuron-fail" and rep.error == "Mismatch: 1"
    only_cpu_fails = models.ModelReport("y", "Y", modes={"eager": models.ModeResult()})
    assert models.classify(only_cpu_fails) == "cpu-fail"


def test_check_exit_codes(capsys, tmp_path):
    assert cli.main(["check", "no_such_model_type"]) == 2
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert cli.main(["check", "--config", str(bad)]) == 2
    assert "error:" in capsys.readouterr().out


def test_check_default_config(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "verdict: llama RUNS on neuron" in out and "TP=" in out


def test_matrix_resume_timeout_and_render(tmp_path, monkeypatch):
    done = {"model_type": "llama", "architecture": "LlamaForCausalLM", "status": "pass",
            "modes": {}, "seconds": 1.0}
    matrix.save(tmp_path / "support-causal-lm.json", "causal-lm", {"llama": done})
    calls = []
    monkeypatch.setattr(matrix, "run_one", lambda mt, arch, task, timeout: calls.append(mt) or {
        "model_type": mt, "architecture": arch, "status": "timeout", "modes": {}, "seconds": 0})
    data = matrix.run_matrix("causal-lm", tmp_path, only=["llama", "gpt2"])
    assert calls == ["gpt2"], "llama was resumed from the partial results"
    assert data["summary"]["counts"] == {"pass": 1, "timeout": 1}
    page = (tmp_path / "support-causal-lm.html").read_text()
    assert "<svg" in page and "sortBy" in page and "gpt2" in page
    assert "| llama |" in (tmp_path / "support-causal-lm.md").read_text()
    assert json.loads((tmp_path / "support-causal-lm.json").read_text())["task"] == "causal-lm"
    assert render.bar_chart({"pass": 3}).startswith("<svg")


def test_worker_timeout_is_a_row():
    row = matrix.run_one("llama", "LlamaForCausalLM", "causal-lm", timeout=0.5)
    assert row["status"] == "timeout"


@pytest.mark.slow
def test_ci_subset(tmp_path):
    data = matrix.run_matrix("causal-lm", tmp_path, jobs=2, only=matrix.CI_SUBSET)
    assert data["summary"]["counts"].get("neuron-fail", 0) == 0, data["summary"]
