"""`neuronlocal serve-plan`: the bucket fitter, the serving simulation, trace parsing, the
configs it prints (applied), the CLI's JSON and errors, and the replay on neuron (slow)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from neuronlocal.cli import main
from neuronlocal.compile.bucketing import fit_buckets, suggest_buckets
from neuronlocal.serve import configs
from neuronlocal.serve import plan as P
from neuronlocal.serve import trace as T
from neuronlocal.serve.sim import Curve, StepTimes, percentile, servable, simulate

TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 1024}


def steps(batch: int = 4) -> StepTimes:
    """Roofline-shaped step times: prefill linear in tokens, decode in KV length."""
    lengths = [16, 128, 256, 512, 1024, 2048, 4096, 8192]
    return StepTimes(Curve({x: 2e-3 + 2e-5 * x for x in lengths}),
                     Curve({x: 5e-3 + 1e-6 * x * batch for x in lengths}), batch)


def long_tail(n: int, seed: int, rate: float | None = 20.0) -> list[T.Request]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate else 0.0
        out.append(T.Request(min(6000, max(4, int(rng.lognormvariate(5.0, 1.0)))),
                             min(1500, max(1, int(rng.lognormvariate(4.0, 0.9)))), t))
    return out


# ---- the pure fitter ---------------------------------------------------------------------------

def test_fit_buckets_is_the_exact_optimum():
    rng = random.Random(0)
    for _ in range(150):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        k = rng.randint(1, 4)
        cost = (lambda b: 1 + b * b) if rng.random() < 0.5 else None
        got = fit_buckets(lengths, k, cost=cost)
        rounded = [-(-x // 8) * 8 for x in lengths]
        vals = sorted(set(rounded))

        def total(bs, cost=cost, rounded=rounded):
            return sum((cost or float)(min(b for b in bs if b >= x)) for x in rounded)

        best = min((total(s), len(s)) for n in range(1, k + 1)
                   for s in itertools.combinations(vals, n) if s[-1] == vals[-1])
        assert (total(got), len(got)) == pytest.approx(best), (lengths, k, got)


def test_suggest_buckets_fits_the_lengths_seen():
    assert suggest_buckets([5, 9, 17]) == [8, 16, 24]  # few lengths: one bucket each
    assert suggest_buckets([8, 16]) == [8, 16]  # already bucketed: nothing better
    # A long tail: powers of two would pad 1..7 to 8 and 129 to 256; the fit does better.
    lengths = [100] * 20 + [101, 129, 300]
    fitted = suggest_buckets(lengths, 3)
    pad = lambda bs: sum(min(b for b in bs if b >= x) - x for x in lengths)  # noqa: E731
    assert len(fitted) <= 3 and max(fitted) >= 300
    assert pad(fitted) < pad([128, 256, 512])
    assert fit_buckets({100: 5.0, 300: 1.0}, 1, largest=512) == [512]


# ---- the plan against the baseline -------------------------------------------------------------

def test_plan_beats_powers_of_two_on_a_long_tailed_trace():
    reqs = long_tail(400, 1)
    f = P.fit(reqs, steps(), P.round_up(max(r.prompt + r.output for r in reqs)), None)
    plan, base = f.plan.as_dict(), f.baseline.as_dict()
    ctx = base["context_buckets"]
    assert ctx[0] == 128 and all(b == 2 * a for a, b in zip(ctx[:-2], ctx[1:-1], strict=True))
    assert f.dominates and plan["graphs"] <= base["graphs"]
    assert plan["padding_fraction"] < base["padding_fraction"]
    assert plan["ttft_ms"]["p99"] < base["ttft_ms"]["p99"]
    assert plan["tpot_ms"]["p99"] <= base["tpot_ms"]["p99"]
    assert plan["cost"] < base["cost"] and plan["unservable"] == base["unservable"]


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_never_worse_than_the_baseline(seed):
    rng = random.Random(seed)
    reqs = long_tail(rng.randint(5, 120), seed, rate=rng.choice([None, 5.0, 50.0]))
    reqs.append(T.Request(9000, 10))  # unservable by both
    max_len = P.round_up(max(r.prompt + r.output for r in reqs[:-1]))
    f = P.fit(reqs, steps(rng.choice([1, 4, 16])), max_len, None)
    p, b = f.plan.as_dict(), f.baseline.as_dict()
    assert p["graphs"] <= b["graphs"] and p["padding_fraction"] <= b["padding_fraction"] + 1e-9
    for k in ("ttft_ms", "tpot_ms"):
        assert b[k]["p99"] is None or p[k]["p99"] <= b[k]["p99"] * (1 + 1e-9)
    assert p["unservable"] == b["unservable"] == 1
    # generate's static cache holds the padded prompt: the plan drops no more there either
    assert p["unservable_static_cache"] <= b["unservable_static_cache"]
    assert p["context_buckets"][-1] == b["context_buckets"][-1]
    assert p["token_buckets"][-1] == b["token_buckets"][-1] == max_len
    assert all(x % P.STEP == 0 for x in p["context_buckets"] + p["token_buckets"])


@pytest.mark.parametrize("seed", [10, 11])
def test_plan_pads_no_request_out_of_generates_cache(seed):
    """Traces where the padding-cheapest fitted context buckets push a padded prompt + output
    past the top token bucket (generate's static cache holds the padding), dropping requests
    the baseline serves: such a plan is not chosen."""
    rng = random.Random(seed)
    reqs = long_tail(rng.randint(5, 120), seed, rate=rng.choice([None, 5.0, 50.0]))
    max_len = P.round_up(max(r.prompt + r.output for r in reqs))
    f = P.fit(reqs, steps(rng.choice([1, 4, 16])), max_len, None)
    assert f.dominates and f.plan.static_unservable <= f.baseline.static_unservable
    assert f.plan.static_unservable == sum(
        not servable(r, f.plan.ctx, f.plan.tg, static_cache=True) for r in reqs)


def test_max_graphs_is_a_hard_limit():
    reqs = long_tail(200, 3)
    f = P.fit(reqs, steps(), 6144, 4)
    assert f.plan.graphs <= 4 < f.baseline.graphs
    assert not f.dominates and "over --max-graphs 4" in f.note
    with pytest.raises(ValueError, match="at least 2"):
        P.fit(reqs, steps(), 6144, 1)


# ---- the simulation ----------------------------------------------------------------------------

def test_simulation_by_hand():
    flat = StepTimes(Curve({16: 0.010, 8192: 0.010}), Curve({16: 0.001, 8192: 0.001}), 1)
    reqs = [T.Request(100, 3), T.Request(60, 1), T.Request(300, 2, arrival=1.0)]
    s = simulate(reqs, [128], [256], flat)
    # r0: prefill 0-10 ms, two decode steps to 12 ms; r1 waits for the slot: prefill 12-22 ms.
    # r2 does not fit a context bucket of 128.
    assert s.ttft == pytest.approx([0.010, 0.022]) and s.tpot == pytest.approx([0.001])
    assert s.unservable == 1 and s.padding_fraction == pytest.approx(1 - 160 / 256)
    assert s.kv_used == 101 + 102 and s.kv_read == 2 * 256
    assert percentile([3, 1, 2], 50) == 2 and percentile([], 99) is None


def test_simulation_batches_decode_and_waits_for_arrivals():
    flat = StepTimes(Curve({16: 0.010, 8192: 0.010}), Curve({16: 0.001, 8192: 0.001}), 2)
    reqs = [T.Request(10, 11), T.Request(10, 11), T.Request(10, 2, arrival=5.0)]
    s = simulate(reqs, [128], [128], flat)
    # Both prefills first (10, 20 ms), then 10 shared decode steps; the third arrives idle.
    assert s.ttft == pytest.approx([0.010, 0.020, 0.010])
    assert s.tpot[:2] == pytest.approx([(0.030 - 0.010) / 10, 0.001])
    assert s.makespan_s == pytest.approx(5.011)


# ---- traces ------------------------------------------------------------------------------------

def test_trace_formats(tmp_path):
    j = tmp_path / "t.jsonl"
    j.write_text('{"prompt_tokens": 10, "output_tokens": 2, "arrival_s": 0.5}\n\n'
                 '{"prompt_tokens": 20, "output_tokens": 3}\n')
    c = tmp_path / "t.csv"
    c.write_text("prompt_tokens,output_tokens,arrival_s\n10,2,0.5\n20,3,\n")
    for path in (j, c):
        t = T.load(str(path))
        assert t.requests == [T.Request(10, 2, 0.5), T.Request(20, 3, 0.0)], path
    rep = {"ranks": [{"bucket_suggestions": [{"sizes": [5, 9, 17]}]}]}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    t = T.load(str(tmp_path / "report.json"))
    assert [r.prompt for r in t.requests] == [5, 9, 17] and "output" in t.note


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["serve-plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text,extra,message", [
    ('{"prompt_tokens": 10}\n', [], "no output_tokens"),
    ("prompt,output_tokens\n1,2\n", [], "no prompt_tokens column"),
    ('{"prompt_tokens": -3, "output_tokens": 2}\n', [], "negative"),
    ('{"prompt_tokens": NaN, "output_tokens": 2}\n', [], "finite"),
    ('{"prompt_tokens": "x", "output_tokens": 2}\n', [], "not a number"),
    ('{"prompt_tokens": 2.5, "output_tokens": 2}\n', [], "whole number"),
    ('{"prompt_tokens": 0, "output_tokens": 2}\n', [], "at least 1"),
    ("\n\n", [], "empty"),
    ("not json\n", [], "no prompt_tokens"),
    ('{"prompt_tokens": 1, "output_tokens": 2}\n{oops\n', [], "not JSON"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--batch", "0"], "--batch is 0"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--max-graphs", "0"], "--max-graphs is 0"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--max-len", "100"], "multiple of 128"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--compile-minutes", "nan"], "positive"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--replay", "2"], "local model folder"),
    ('{"prompt_tokens": 900, "output_tokens": 2}\n', ["--max-len", "128"], "no request"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--instance", "trn9.x"], "trn9.x"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--tp", "3"], "does not divide"),
    ('{"prompt_tokens": 10, "output_tokens": 2}\n', ["--tp", "4"], "attention heads"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, extra, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    code, out, err = _cli(capsys, str(cfg), "--trace", str(path), *extra)
    assert code == 2 and out == "" and message in err, err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_unreadable_oversized_and_overlong_traces(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    code, _, err = _cli(capsys, str(cfg), "--trace", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read the trace" in err and err.count("\n") == 1
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt_tokens": 1, "output_tokens": 1}\n' * 50)
    monkeypatch.setattr(T, "MAX_REQUESTS", 10)
    code, _, err = _cli(capsys, str(cfg), "--trace", str(big))
    assert code == 2 and "more than 10 requests" in err
    monkeypatch.setattr(T, "MAX_BYTES", 100)
    code, _, err = _cli(capsys, str(cfg), "--trace", str(big))
    assert code == 2 and "MiB" in err and err.count("\n") == 1


# ---- the CLI's output and the configs it prints ------------------------------------------------

def test_json_schema_and_table(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_tokens": r.prompt, "output_tokens": r.output,
                                        "arrival_s": r.arrival}) + "\n"
                            for r in long_tail(60, 5) if r.prompt + r.output <= 900))
    code, out, err = _cli(capsys, str(cfg), "--trace", str(path), "--batch", "4", "--json")
    assert code == 0, err
    res = json.loads(out)
    for side in ("plan", "baseline"):
        r = res[side]
        assert isinstance(r["context_buckets"], list) and isinstance(r["token_buckets"], list)
        assert r["graphs"] == len(r["context_buckets"]) + len(r["token_buckets"])
        assert r["warmup_s"] == pytest.approx(r["graphs"] * P.COMPILE_MINUTES * 60, abs=0.1)
        assert 0 <= r["padding_fraction"] < 1 and r["unservable"] == 0
        for k in ("ttft_ms", "tpot_ms"):
            assert set(r[k]) == {"p50", "p99"} and 0 < r[k]["p50"] <= r[k]["p99"]
    assert res["setup"]["hbm"]["fits"] and "no published" in res["setup"]["warmup"]
    code, out, _ = _cli(capsys, str(cfg), "--trace", str(path), "--batch", "4")
    assert code == 0 and "baseline (powers of two" in out and "context_encoding_buckets" in out
    assert "num_batched_tokens_buckets" in out and "pad_to_bucket" in out


def test_config_emitters_follow_the_documented_rules():
    ctx, tg = [256, 640, 2048], [384, 1024, 4096]
    nxd = configs.nxd_inference(ctx, tg, 8)
    assert nxd["enable_bucketing"] and nxd["context_encoding_buckets"] == ctx
    assert nxd["token_generation_buckets"] == tg and nxd["seq_len"] == 4096
    assert nxd["max_context_length"] == 2048 and nxd["batch_size"] == 8
    v = configs.vllm_neuron(ctx, tg, 8)
    n = v["additional_config"]["neuron_config"]
    assert n["num_batched_tokens_buckets"][-1] == v["max_num_batched_tokens"]
    assert n["num_seqs_buckets"][-1] == v["max_num_seqs"] == 8
    # decode buckets: multiples of 128, strictly below max_model_len (its graph is implicit)
    assert n["decode_context_length_buckets"] == [384, 1024] and v["max_model_len"] == 4096
    assert "decode_context_length_buckets" not in configs.vllm_neuron(ctx, [4096], 8)[
        "additional_config"]["neuron_config"]


def test_generate_config_applied_matches_unpadded_generation():
    """The printed transformers snippet, run as printed: same greedy tokens as no padding."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in TINY.items() if k != "model_type"})).eval()
    for length, new in ((20, 5), (130, 3)):
        input_ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(1))
        scope = {"model": model, "input_ids": input_ids, "pad_id": 0, "max_new_tokens": new}
        exec(configs.generate_snippet([128, 256], [256, 512]), scope)
        ref = model.generate(input_ids, max_new_tokens=new, do_sample=False)
        got = scope["out"][0, scope["ids"].shape[-1]:]
        # the cache holds the padded prompt and the new tokens
        assert scope["size"] == (256 if length <= 128 else 512)
        assert scope["cache"].layers[0].keys.shape[-2] == scope["size"]
        assert torch.equal(got, ref[0, length:]), length


# ---- the replay on neuron ----------------------------------------------------------------------

@pytest.mark.slow
def test_replay_serves_without_recompiles(tmp_path, capsys):
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in TINY.items() if k != "model_type"})).save_pretrained(tmp_path / "m")
    path = tmp_path / "trace.jsonl"
    reqs = [(20, 4), (100, 6), (64, 3), (120, 5), (37, 2)]
    path.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
                            for p, o in reqs))
    code, out, err = _cli(capsys, str(tmp_path / "m"), "--trace", str(path), "--max-len", "384",
                          "--max-graphs", "3", "--replay", "5", "--json")
    assert code == 0, err
    res = json.loads(out)
    r = res["replay"]
    assert r["error"] is None and r["recompiles_after_warmup"] == 0
    # the decode step compiled once per token bucket it can use (padded prompt + output)
    assert r["requests"] == 5 and r["outputs_match"]
    assert r["graphs_warmed"] == len(r["token_buckets_warmed"]) >= 1
    assert set(r["token_buckets_warmed"]) <= set(res["plan"]["token_buckets"])
    assert all(math.isfinite(r[k]["p50"]) for k in ("host_ttft_ms", "host_tpot_ms",
                                                    "estimated_ttft_ms"))
    from neuronlocal.serve.cli import render

    assert "0 recompiles after warm-up" in render(res)


@pytest.mark.slow
def test_replay_checks_the_queueing_simulation(tmp_path, capsys):
    """The simulation predicts the replay's measured TTFT and TPOT (p50, p99) within 15%:
    requests arrive (rescaled to the host) and queue; simulated on each request's own
    measured service always, and on one median step time per bucket when the host's speed
    held over the run (other jobs on the machine change it between requests)."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in TINY.items() if k != "model_type"})).save_pretrained(tmp_path / "m")
    rng, t, rows = random.Random(2), 0.0, []
    for _ in range(24):
        t += rng.expovariate(1.0)
        rows.append({"prompt_tokens": rng.randint(10, 120), "output_tokens": rng.randint(12, 40),
                     "arrival_s": round(t, 3)})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = _cli(capsys, str(tmp_path / "m"), "--trace", str(path), "--max-len", "384",
                          "--max-graphs", "3", "--replay", "24", "--json")
    assert code == 0, err
    res = json.loads(out)
    r = res["replay"]
    assert r["error"] is None and r["recompiles_after_warmup"] == 0 and r["requests"] == 24
    q = r["queueing_check"]
    own = q["own_steps"]
    assert own["host_ttft_ms"]["p99"] > 1.5 * own["host_ttft_ms"]["p50"]  # requests did queue
    assert all(abs(e) <= 0.15 for e in own["relative_error"].values()), own
    assert own["within_goal"] and q["unservable"] == 0
    from neuronlocal.serve.cli import render

    assert "queueing check, simulation on each request's own" in render(res)
    med = q["bucket_medians"]
    if q["host_tpot_spread"] > 0.15:  # the slowest request's TPOT vs the median one's
        pytest.skip(f"the host's decode steps vary by {q['host_tpot_spread']:.0%} between "
                    f"requests (a loaded machine): one median per bucket cannot hold within "
                    f"15%; {med['relative_error']}")
    assert all(abs(e) <= 0.15 for e in med["relative_error"].values()), med


# ---- every input is read with bounds: one line and exit 2 --------------------------------

def _report_trace(sizes) -> str:
    return json.dumps({"ranks": [{"bucket_suggestions": [{"sizes": sizes}]}]})


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "not a CSV header or JSON"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "not JSON"),
    ('{"prompt_tokens": 10, "output_tokens": 2, "arrival_s": 1e308}\n', "up to 1e+07"),
    ("prompt_tokens,output_tokens\n" + "1" * (128 * 2**10 + 10) + ",2\n", "not a CSV row"),
    (json.dumps({"ranks": {"x": 1}}), "not a run report"),
    (json.dumps({"ranks": [{"bucket_suggestions": [{"sizes": "12"}]}]}), "not a run report"),
    (_report_trace([-5]), "negative"),
    (_report_trace([0, 4]), "at least 1"),
    (_report_trace([12.5]), "whole number"),
    (_report_trace([[3]]), "not a number"),
])
def test_traces_out_of_bounds_are_one_line_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    code, out, err = _cli(capsys, str(cfg), "--trace", str(path))
    assert code == 2 and out == "" and message in err, err[:500]
    assert err.count("\n") == 1 and len(err) < 400


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_trace_or_config_that_is_no_file_is_refused_before_it_is_read(tmp_path, capsys,
                                                                         kind):
    """A FIFO would block forever and /dev/zero never ends: both are refused in one line."""
    import os

    if kind == "fifo":
        special = tmp_path / "fifo"
        os.mkfifo(special)
    else:
        special = "/dev/zero"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_tokens": 10, "output_tokens": 2}\n')
    code, _, err = _cli(capsys, str(cfg), "--trace", str(special))
    assert code == 2 and "is not a regular file" in err and err.count("\n") == 1, err
    code, _, err = _cli(capsys, str(special), "--trace", str(trace))
    assert code == 2 and err.count("\n") == 1, err
    assert main(["check", "--config", str(special)]) == 2
    out, err = capsys.readouterr()
    assert "is not a regular file" in out + err and len((out + err).splitlines()) == 1


@pytest.mark.parametrize("extra, message", [
    (["--max-graphs", str(10**9)], "--max-graphs is 1000000000"),
    (["--compile-minutes", "1e308"], "--compile-minutes is 1e+308"),
    (["--batch", str(10**9)], "--batch is"),
    (["--max-len", str(2**40)], "--max-len is"),
    (["--replay", str(10**9)], "--replay is"),
])
def test_numeric_options_past_their_bounds_are_one_line_exit_2(tmp_path, capsys, extra,
                                                                message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_tokens": 10, "output_tokens": 2}\n')
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    code, out, err = _cli(capsys, str(cfg), "--trace", str(path), *extra)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_replay_of_a_folder_without_weights_or_too_few_positions_is_one_line(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, "max_position_embeddings": 256}))
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_tokens": 300, "output_tokens": 2}\n')
    code, _, err = _cli(capsys, str(folder), "--trace", str(path), "--replay", "1")
    assert code == 2 and "needs the model's weights" in err and err.count("\n") == 1, err
    (folder / "model.safetensors").write_bytes(b"")
    code, _, err = _cli(capsys, str(folder), "--trace", str(path), "--replay", "1")
    assert code == 2 and "over the model's 256 positions" in err and err.count("\n") == 1, err


def test_a_replay_that_serves_nothing_exits_1(tmp_path, capsys, monkeypatch):
    """The replay's verdict is the exit status: 0 of N requests served is a failure."""
    from neuronlocal.serve import replay as R

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    (folder / "model.safetensors").write_bytes(b"")
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_tokens": 10, "output_tokens": 2}\n')
    served = {"requests": 0, "skipped_no_bucket": 1, "graphs_warmed": 0,
              "token_buckets_warmed": [], "recompiles_after_warmup": 0, "error": None,
              "outputs_match": False, **{k: {"p50": None, "p99": None} for k in (
                  "host_ttft_ms", "host_tpot_ms", "estimated_ttft_ms", "estimated_tpot_ms")}}
    monkeypatch.setattr(R, "replay", lambda *a: served)
    code, _, err = _cli(capsys, str(folder), "--trace", str(path), "--replay", "1", "--json")
    assert code == 1 and "0 of 1 requests served" in err
