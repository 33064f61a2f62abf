"""`serve-plan --slo-*`: the cheapest rental meeting latency targets, checked by applying
it (simulating the answer, and searching with one instance fewer), and the failure report."""

from __future__ import annotations

import json
import random

import pytest

from neuronlocal.cli import main
from neuronlocal.estimate.workload import load_config
from neuronlocal.serve import slo as S
from neuronlocal.serve import trace as T
from neuronlocal.serve.plan import step_times
from neuronlocal.serve.sim import simulate

TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 1024}
TARGETS = {"ttft_p99": 0.05, "tpot_p99": 0.01}


def _files(tmp_path, rate: float) -> tuple[str, str]:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    rng = random.Random(1)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_tokens": rng.randint(20, 400),
                                        "output_tokens": rng.randint(2, 60),
                                        "arrival_s": i / rate}) + "\n" for i in range(300)))
    return str(cfg), str(path)


def test_the_answer_meets_the_targets_and_one_instance_fewer_does_not(tmp_path):
    cfg_path, path = _files(tmp_path, 50_000.0)
    reqs, cfg = T.load(path).requests, load_config(cfg_path)
    args = ("trn2.48xlarge", None, 512, 6)
    out = S.search(reqs, cfg, *args, TARGETS, 16, 35.76, "assumed", 6.7)
    best = out["best"]
    assert out["met"] and best["instances"] >= 2 and out["powers_of_two"] is not None
    assert out["powers_of_two"]["instances"] >= best["instances"]
    assert best["graphs"] <= 6 and best["cost_per_hour"] == pytest.approx(35.76 * best["instances"])
    steps = step_times(cfg, "trn2.48xlarge", best["tp"], best["batch"], 512)[0]
    sim = simulate(reqs, best["context_buckets"], best["token_buckets"], steps,
                   best["replicas"])
    assert all(r <= 1 for r in S.ratios(sim, TARGETS).values())
    assert S.value(sim, "ttft_p99") * 1e3 == pytest.approx(best["latency_ms"]["ttft_p99"],
                                                           abs=1e-3)
    fewer = S.search(reqs, cfg, *args, TARGETS, best["instances"] - 1, 35.76, "assumed", 6.7)
    assert not fewer["met"] and "fails first" in fewer["failure"]


def test_cli_prints_the_answer_and_an_impossible_target(tmp_path, capsys):
    cfg, path = _files(tmp_path, 2_000.0)
    code = main(["serve-plan", cfg, "--trace", path, "--slo-ttft-p99", "0.05",
                 "--slo-tpot-p50", "0.01"])
    out = capsys.readouterr().out
    assert code == 0 and "SLO search (TTFT P99 <= 0.05 s, TPOT P50 <= 0.01 s" in out
    assert "cheapest: 1 x trn2.48xlarge" in out and "per million output tokens" in out
    assert "cheapest powers of two:" in out and "HBM per core" in out
    code = main(["serve-plan", cfg, "--trace", path, "--slo-ttft-p99", "1e-6", "--json"])
    res = json.loads(capsys.readouterr().out)["slo"]
    assert code == 0 and not res["met"] and res["best"] is None
    assert res["failure"].startswith("TTFT P99 fails first") and "x the target" in res["failure"]


CONFIG_FIELDS = {"replicas", "instances", "capacity_rps", "arrival_rps", "saturated",
                 "cost_per_hour", "cost_per_million_tokens"}


def test_every_configuration_in_the_json_carries_capacity_and_cost(tmp_path, capsys):
    """The plan, the baseline and both SLO answers each say replicas, instances, capacity,
    arrival rate, saturation and cost; the search result is under "slo"."""
    cfg, path = _files(tmp_path, 2_000.0)
    code = main(["serve-plan", cfg, "--trace", path, "--slo-ttft-p99", "0.05", "--json"])
    res = json.loads(capsys.readouterr().out)
    slo = res["slo"]
    assert code == 0 and slo["met"]
    for r in (res["plan"], res["baseline"], slo["best"], slo["powers_of_two"]):
        assert CONFIG_FIELDS <= set(r), CONFIG_FIELDS - set(r)
        assert r["arrival_rps"] == pytest.approx(2_000.0, rel=0.01) and not r["saturated"]
        assert r["cost_per_hour"] == pytest.approx(35.76 * r["instances"])


@pytest.mark.parametrize("extra,message", [
    (["--slo-ttft-p99", "0"], "--slo-ttft-p99 is 0.0"),
    (["--slo-tpot-p50", "nan"], "--slo-tpot-p50 is nan"),
    (["--max-instances", "0"], "--max-instances is 0"),
])
def test_bad_targets_are_one_line(tmp_path, capsys, extra, message):
    cfg, path = _files(tmp_path, 100.0)
    code = main(["serve-plan", cfg, "--trace", path, *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and message in err and err.count("\n") == 1
