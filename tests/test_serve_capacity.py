"""`neuronlocal serve-plan` capacity: several replicas by join-shortest-queue, what one
replica sustains, the overload warning (and its advice applied), and the cost fields."""

from __future__ import annotations

import json
import random
import re

import pytest

from neuronlocal.cli import main
from neuronlocal.serve import capacity as C
from neuronlocal.serve import trace as T
from neuronlocal.serve.sim import Curve, StepTimes, simulate

TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 1024}
FLAT = StepTimes(Curve({16: 0.010, 8192: 0.010}), Curve({16: 0.001, 8192: 0.001}), 1)


def test_join_shortest_queue_by_hand():
    reqs = [T.Request(100, 3), T.Request(100, 3), T.Request(100, 2, arrival=0.005),
            T.Request(100, 2, arrival=0.0115)]
    s = simulate(reqs, [128], [256], FLAT, replicas=2)
    # r0 and r1 prefill at once on the two replicas (0-10 ms) and decode to 12 ms. r2 finds
    # one request on each (a tie: replica 0) and is prefilled there at 12-22 ms. r3 arrives
    # at 11.5 ms, when replica 1 (r1 ends at 12 ms) holds one request and replica 0 two.
    assert s.ttft == pytest.approx([0.010, 0.010, 0.017, 0.0105])
    assert simulate(reqs, [128], [256], FLAT, replicas=1).ttft == pytest.approx(
        [0.010, 0.022, 0.029, 0.0335])  # one replica: each waits for the one before


def test_more_replicas_never_lengthen_the_queue():
    rng, t, reqs = random.Random(3), 0.0, []
    for _ in range(300):
        t += rng.expovariate(150.0)
        reqs.append(T.Request(rng.randint(10, 120), rng.randint(1, 30), t))
    batch4 = StepTimes(FLAT.prefill, FLAT.decode, 4)
    p99 = [sorted(simulate(reqs, [128], [256], batch4, n).ttft)[296] for n in (1, 2, 4, 8)]
    assert p99 == sorted(p99, reverse=True) and 0.010 <= p99[-1] < 0.012  # a step's wait


def test_capacity_and_arrival_rate_by_hand():
    reqs = [T.Request(100, 1, arrival=i / 50) for i in range(11)]
    cap = C.capacity(reqs, [128], [256], FLAT)  # prefill only: 10 ms a request
    assert cap.rps == pytest.approx(100.0) and cap.output_tps == pytest.approx(100.0)
    assert C.arrival_rate(reqs) == pytest.approx(50.0)
    assert C.arrival_rate([T.Request(1, 1)] * 3) is None
    assert C.keep_up(250.0, cap) == 3 and C.keep_up(None, cap) is None
    c = C.cost(reqs, cap, 1, 2, 10.0, "given")
    assert c.per_hour == 20.0 and c.served_output_tps == pytest.approx(11 / 0.2)
    assert c.per_million_output == pytest.approx(20.0 / (3600 * 55.0) * 1e6)


def _run(capsys, tmp_path, *extra: str) -> tuple[int, str, str]:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    path = tmp_path / "trace.jsonl"
    if not path.exists():
        rng = random.Random(1)
        path.write_text("".join(json.dumps({"prompt_tokens": rng.randint(20, 400),
                                            "output_tokens": rng.randint(2, 60),
                                            "arrival_s": i / 150}) + "\n" for i in range(200)))
    code = main(["serve-plan", str(cfg), "--trace", str(path), "--batch", "4", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_overload_is_the_first_line_and_its_advice_works(tmp_path, capsys):
    code, out, err = _run(capsys, tmp_path, "--replicas", "1")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("WARNING: overloaded") and "TTFT is unbounded" in first
    assert "unbounded (sim" in out and "compared on graphs, padding and capacity" in out
    need = re.search(r"; (\d+) replicas would keep up", first)
    assert need, first
    code, out, _ = _run(capsys, tmp_path, "--replicas", need.group(1), "--json")
    res = json.loads(out)
    assert code == 0 and not res["saturated"]
    for side in ("plan", "baseline"):
        r = res[side]
        assert r["replicas"] == int(need.group(1)) and r["instances"] == 1
        assert r["arrival_rps"] == pytest.approx(150.0, rel=0.01)
        assert r["replicas"] * r["capacity_rps"] > r["arrival_rps"] and not r["saturated"]
        assert r["cost_per_hour"] == pytest.approx(35.76) and r["cost_per_million_tokens"] > 0
    assert res["setup"]["dispatch"] == "join-shortest-queue"
    assert "WARNING" not in _run(capsys, tmp_path, "--replicas", need.group(1))[1]


def test_default_replicas_fill_the_instance(tmp_path, capsys):
    code, out, err = _run(capsys, tmp_path, "--instances", "2", "--price-per-hour", "1",
                          "--json")
    res = json.loads(out)
    assert code == 0 and res["plan"]["replicas"] == 128 and res["plan"]["cost_per_hour"] == 2
    assert res["setup"]["replicas_per_instance"] == 64


@pytest.mark.parametrize("extra,message", [
    (["--replicas", "0"], "--replicas is 0"),
    (["--replicas", "65"], "needs 65 logical cores"),
    (["--instances", "0"], "--instances is 0"),
    (["--price-per-hour", "-1"], "--price-per-hour is -1"),
])
def test_bad_capacity_input_is_one_line(tmp_path, capsys, extra, message):
    code, out, err = _run(capsys, tmp_path, *extra)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


@pytest.mark.parametrize("positions,warned", [(1024, True), (131072, False)])
def test_max_position_embeddings_is_read_from_the_config(tmp_path, capsys, positions, warned):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "max_position_embeddings": positions}))
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_tokens": 1000, "output_tokens": 100}\n'
                    '{"prompt_tokens": 500, "output_tokens": 100}\n')
    code = main(["serve-plan", str(cfg), "--trace", str(path), "--json"])
    note = json.loads(capsys.readouterr().out)["setup"]["length_note"]
    assert code == 0 and (f"max_position_embeddings {positions}" in note) == warned
    assert ("--max-len 1024 or less" in note) == warned
    if warned:  # the advice applied: no warning, the longer request unservable
        code = main(["serve-plan", str(cfg), "--trace", str(path), "--max-len", "1024",
                     "--json"])
        res = json.loads(capsys.readouterr().out)
        assert code == 0 and res["setup"]["length_note"] == ""
        assert res["plan"]["unservable"] == 1
