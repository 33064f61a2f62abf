"""`neuronlocal serve-plan`: bucket lists, graphs, warm-up and p99 latency for a trace.

Exit status 0 with a plan, 2 on bad input (one line naming the problem and the fix).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from neuronlocal.core.units import fmt_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a preset (e.g. llama-3.1-8b), a transformers model type, a "
                                 "config.json, or a local model folder")
    p.add_argument("--trace", required=True, help="JSONL or CSV with prompt_tokens, "
                   "output_tokens[, arrival_s] per request, or a run report's report.json")
    p.add_argument("--instance", default="trn2.48xlarge", help="default trn2.48xlarge")
    p.add_argument("--lnc", type=int, choices=(1, 2), help="logical core size (Trn2/Trn3)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of one replica")
    p.add_argument("--replicas", type=int, help="replicas per instance (default: as many as "
                   "the instance holds at --tp); arrivals join the shortest queue")
    p.add_argument("--instances", type=int, default=1, help="instances rented (default 1)")
    p.add_argument("--price-per-hour", type=float, help="USD per instance-hour (default: "
                   "neuronlocal estimate's price table)")
    for kind, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        for q in ("p99", "p50"):
            p.add_argument(f"--slo-{kind}-{q}", type=float, metavar="S", help=f"target {q} "
                           f"{what}, seconds: search for the cheapest rental meeting every "
                           "target given")
    p.add_argument("--max-instances", type=int, default=16, help="instances the SLO search "
                   "goes up to (default 16)")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-graphs", type=int, help="graphs to compile at most (default: as "
                                                  "many as the powers-of-two baseline)")
    p.add_argument("--max-len", type=int, help="longest prompt + output served, a multiple of "
                   "128 (default: the trace's longest, rounded up)")
    p.add_argument("--compile-minutes", type=float, help="neuronx-cc minutes per graph "
                   "(default: the middle of the reported band; no published figure exists)")
    p.add_argument("--replay", type=int, metavar="N", help="run the first N requests on "
                   "neuron with the plan's buckets (MODEL must be a local model folder)")
    p.add_argument("--json", action="store_true", help="print JSON")


# Upper bounds of the numeric options: far past any real plan, short of a search that
# never ends or a number JSON cannot print.
MAX_BATCH, MAX_TP, MAX_GRAPHS, MAX_LEN = 4096, 1024, 256, 2**21
MAX_COMPILE_MINUTES, MAX_REPLAY, MAX_REPLICAS = 10**4, 10**4, 1024
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def _targets(args: argparse.Namespace) -> dict[str, float]:
    """The latency targets given, by name ('ttft_p99': seconds)."""
    names = [f"{k}_{q}" for k in ("ttft", "tpot") for q in ("p50", "p99")]
    return {n: v for n in names if (v := getattr(args, f"slo_{n}", None)) is not None}


def _problem(args: argparse.Namespace) -> str | None:
    checks = [
        (not 1 <= args.batch <= MAX_BATCH, f"--batch is {args.batch}; give 1 to {MAX_BATCH}"),
        (not 1 <= args.tp <= MAX_TP, f"--tp is {args.tp}; give 1 to {MAX_TP}"),
        (args.replicas is not None and not 1 <= args.replicas <= MAX_REPLICAS,
         f"--replicas is {args.replicas}; give 1 to {MAX_REPLICAS}"),
        (not 1 <= args.instances <= MAX_REPLICAS,
         f"--instances is {args.instances}; give 1 to {MAX_REPLICAS}"),
        (not 1 <= args.max_instances <= MAX_REPLICAS,
         f"--max-instances is {args.max_instances}; give 1 to {MAX_REPLICAS}"),
        *((not (math.isfinite(v) and v > 0), f"--slo-{k.replace('_', '-')} is {v}; give a "
           "positive number of seconds") for k, v in _targets(args).items()),
        (args.price_per_hour is not None and not (math.isfinite(args.price_per_hour)
                                                  and args.price_per_hour >= 0),
         f"--price-per-hour is {args.price_per_hour}; give a price of 0 or more"),
        (args.max_graphs is not None and not 2 <= args.max_graphs <= MAX_GRAPHS,
         f"--max-graphs is {args.max_graphs}; give 2 (one prefill and one decode graph) to "
         f"{MAX_GRAPHS}"),
        (args.max_len is not None and (not 128 <= args.max_len <= MAX_LEN
                                       or args.max_len % 128),
         f"--max-len is {args.max_len}; give a multiple of 128 (the bucket step) up to "
         f"{MAX_LEN}"),
        (args.compile_minutes is not None and not (math.isfinite(args.compile_minutes)
                                                   and 0 < args.compile_minutes
                                                   <= MAX_COMPILE_MINUTES),
         f"--compile-minutes is {args.compile_minutes}; give a positive number up to "
         f"{MAX_COMPILE_MINUTES}"),
        (args.replay is not None and not 1 <= args.replay <= MAX_REPLAY,
         f"--replay is {args.replay}; give the number of requests to run, 1 to {MAX_REPLAY}"),
        (args.replay is not None and not Path(args.model, "config.json").is_file(),
         f"--replay needs a local model folder (save_pretrained) as MODEL, not {args.model!r}"),
        (args.replay is not None and Path(args.model, "config.json").is_file()
         and not any(any(Path(args.model).glob(w)) for w in _WEIGHTS),
         f"--replay needs the model's weights in {args.model} (model.safetensors from "
         "save_pretrained); the folder has only a config"),
    ]
    return next((msg for bad, msg in checks if bad), None)


def _max_len(args: argparse.Namespace, requests: list[Any]) -> int:
    from neuronlocal.serve.plan import default_max_len

    return int(args.max_len) if args.max_len is not None else default_max_len(requests)


def _position_note(cfg: Any, max_len: int) -> str:
    """A warning when the plan serves more positions than the model's config has."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if limit and max_len > int(limit):
        return (f"max length {max_len} is over the model config's max_position_embeddings "
                f"{limit}: the model is not trained that long; give --max-len {int(limit)} or "
                "less (requests longer than it are then unservable), or check the config")
    return ""


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.1f} ms" if v < 1e4 else f"{v / 1e3:.2f} s")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.0f}%"


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def _lat(r: dict[str, Any], k: str) -> str:
    text = f"{_ms(r[k]['p50'])} / {_ms(r[k]['p99'])}"
    return f"unbounded (sim {text})" if r["saturated"] and k == "ttft_ms" else text


def _usd(v: float | None, digits: int = 2) -> str:
    return "unknown" if v is None else f"${v:,.{digits}f}"


def overload_warning(out: dict[str, Any]) -> str:
    """The first line when arrivals exceed what the replicas serve (empty when they do not)."""
    m, p = out["setup"], out["plan"]
    if not out["saturated"]:
        return ""
    r = p if p["saturated"] else out["baseline"]
    return (f"WARNING: overloaded: requests arrive at {r['arrival_rps']:.2f}/s (the trace's "
            f"rate) but {r['replicas']} replica(s) of TP={m['tp']} at batch {m['batch']} serve "
            f"at most {r['replicas'] * r['capacity_rps']:.2f}/s on this mix (simulated): the "
            "queue grows for as long as the trace lasts and TTFT is unbounded; "
            f"{r['replicas_to_keep_up']} replicas would keep up (--replicas/--instances; "
            "--slo-ttft-p99 finds what meets a target)")


def render(out: dict[str, Any]) -> str:
    from neuronlocal.serve import configs

    m, p, b = out["setup"], out["plan"], out["baseline"]
    rows = [
        ("context buckets", ", ".join(map(str, p["context_buckets"])),
         ", ".join(map(str, b["context_buckets"]))),
        ("token buckets", ", ".join(map(str, p["token_buckets"])),
         ", ".join(map(str, b["token_buckets"]))),
        ("graphs to compile", str(p["graphs"]), str(b["graphs"])),
        ("warm-up (estimated)", *(f"{_minutes(r['warmup_s'])} ({_minutes(r['warmup_band_s'][0])}"
                                  f"-{_minutes(r['warmup_band_s'][1])})" for r in (p, b))),
        ("padding, prefill tokens", f"{100 * p['padding_fraction']:.1f}%",
         f"{100 * b['padding_fraction']:.1f}%"),
        ("wasted KV reads, decode", f"{100 * p['kv_waste_fraction']:.1f}%",
         f"{100 * b['kv_waste_fraction']:.1f}%"),
        ("capacity, 1 replica (sim)", *(f"{r['capacity_rps']:.2f} req/s, "
                                        f"{r['capacity_output_tokens_per_s']:,.0f} out tok/s"
                                        for r in (p, b))),
        ("utilisation (sim)", *("offline batch" if r["arrival_rps"] is None else
                                f"{r['arrival_rps'] / (r['replicas'] * r['capacity_rps']):.0%}"
                                for r in (p, b))),
        *((f"{k.split('_')[0].upper()} p50 / p99 (sim)", _lat(p, k), _lat(b, k))
          for k in ("ttft_ms", "tpot_ms")),
        ("unservable requests", str(p["unservable"]), str(b["unservable"])),
        ("unservable, generate cache", str(p["unservable_static_cache"]),
         str(b["unservable_static_cache"])),
        ("$ per M out tokens (sim)", _usd(p["cost_per_million_tokens"], 3),
         _usd(b["cost_per_million_tokens"], 3)),
        ("cost (docs/serving.md)", f"{p['cost']:.4f}", f"{b['cost']:.4f}"),
    ]
    w = max(len(r[1]) for r in rows) + 2
    rate = p["arrival_rps"]
    lines = [line for line in [overload_warning(out)] if line]
    lines += [f"{m['model']}: {m['requests']:,} requests ({m['trace_format']}, "
              + ("offline batch" if rate is None else f"arriving at {rate:.2f}/s")
              + f"), {p['replicas']} replica(s) of TP={m['tp']} "
              f"({m['replicas_per_instance']} on each of {m['instances']} {m['instance']}, "
              f"{m['dispatch']}), batch {m['batch']}, max length {m['max_len']}; "
              f"{_usd(p['cost_per_hour'])}/hour ({m['price_note']})", ""]
    lines.append(f"{'':28}{'plan':{w}}baseline (powers of two from 128)")
    lines += [f"{name:28}{a:{w}}{c}" for name, a, c in rows]
    h = m["hbm"]
    lines += ["", f"HBM per core: weights {fmt_bytes(h['weights'])} + KV cache "
              f"{fmt_bytes(h['kv_cache'])} at {m['max_len']} tokens x batch {m['batch']} = "
              f"{fmt_bytes(h['total'])} of {fmt_bytes(h['per_core'])} "
              f"({'fits' if h['fits'] else 'DOES NOT FIT'})"]
    if not out["dominates"] or out["saturated"]:
        lines.append(f"note: {out['note']}")
    lines += [f"note: {m[k]}" for k in ("trace_note", "length_note") if m.get(k)]
    if "slo" in out:
        from neuronlocal.serve.slo import render as render_slo

        lines += ["", *render_slo(out["slo"], m["instance"]), ""]
    lines += [f"estimates: {m['estimates']}", f"warm-up: {m['warmup']}", "",
              configs.render(p["context_buckets"], p["token_buckets"], m["batch"])]
    if "replay" in out:
        r = out["replay"]
        lines += ["", f"replay of {r['requests']} requests on neuron (host, batch 1): "
                  f"{r['recompiles_after_warmup']} recompiles after warm-up of "
                  f"{r['graphs_warmed']} graphs; host TTFT p50 {_ms(r['host_ttft_ms']['p50'])}"
                  f", TPOT p50 {_ms(r['host_tpot_ms']['p50'])} (estimated Trainium TTFT p50 "
                  f"{_ms(r['estimated_ttft_ms']['p50'])}, TPOT "
                  f"{_ms(r['estimated_tpot_ms']['p50'])}); outputs match the unpadded run: "
                  f"{r['outputs_match']}"]
        q = r["queueing_check"]
        for mode, what in (("own_steps", "each request's own measured service"),
                           ("bucket_medians", "one median step time per bucket")):
            c = q[mode]
            cells = [f"{k.upper()} {n}: measured {_ms(c[f'host_{k}_ms'][n])}, simulated "
                     f"{_ms(c[f'simulated_{k}_ms'][n])} ({_pct(c['relative_error'][f'{k}_{n}'])})"
                     for k in ("ttft", "tpot") for n in ("p50", "p99")]
            lines.append(f"queueing check, simulation on {what} (goal within "
                         f"{q['goal']:.0%}: {'met' if c['within_goal'] else 'NOT met'}): "
                         + "; ".join(cells))
        lines.append(f"host decode-step spread (slowest request's TPOT over the median's): "
                     f"{_pct(q['host_tpot_spread'])}")
    return "\n".join(lines)


def _capacity(requests: list[Any], r: Any, steps: Any, replicas: int, instances: int,
              usd: float | None, price_note: str) -> dict[str, Any]:
    """Capacity, saturation and cost of one configuration (simulated, and priced)."""
    from neuronlocal.serve.capacity import arrival_rate, capacity, cost, keep_up

    cap = capacity(requests, r.ctx, r.tg, steps)
    rate = arrival_rate(requests)
    total = replicas * instances
    c = cost(requests, cap, total, instances, usd, price_note)
    return {"replicas": total, "instances": instances, "capacity_rps": round(cap.rps, 6),
            "capacity_output_tokens_per_s": round(cap.output_tps, 3),
            "capacity_prompt_tokens_per_s": round(cap.prompt_tps, 3),
            "arrival_rps": None if rate is None else round(rate, 6),
            "saturated": rate is not None and rate >= total * cap.rps,
            "replicas_to_keep_up": keep_up(rate, cap),
            "served_output_tokens_per_s": round(c.served_output_tps, 3),
            "cost_per_hour": c.per_hour,
            "cost_per_million_tokens": None if c.per_million_output is None
            else round(c.per_million_output, 6)}


def _dominates_unqueued(f: Any, sides: dict[str, dict[str, Any]]) -> bool:
    """Overloaded: the plan is no worse on graphs, padding and capacity (latencies left out,
    as they grow with the trace)."""
    p, b = f.plan, f.baseline
    return (p.graphs <= b.graphs and p.sim.unservable <= b.sim.unservable
            and p.static_unservable <= b.static_unservable
            and p.sim.padding_fraction <= b.sim.padding_fraction + 1e-9
            and sides["plan"]["capacity_rps"] >= sides["baseline"]["capacity_rps"] * (1 - 1e-9))


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan as plain data; raises TraceError, WorkloadError or ValueError on bad input."""
    from neuronlocal.estimate import band_width
    from neuronlocal.estimate.layout import Layout, problems
    from neuronlocal.estimate.rates import instance
    from neuronlocal.estimate.workload import load_config, shape
    from neuronlocal.serve import configs
    from neuronlocal.serve.capacity import hourly_price
    from neuronlocal.serve.plan import (
        COMPILE_MINUTES,
        COMPILE_MINUTES_BAND,
        COMPILE_SOURCES,
        fit,
        step_times,
    )
    from neuronlocal.serve.trace import load

    trace = load(args.trace)
    try:
        cores = instance(args.instance, args.lnc).cores
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    if cores % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the {cores} logical cores of "
                         f"{args.instance}; give a divisor of {cores}")
    replicas = args.replicas or cores // args.tp
    if replicas * args.tp > cores:
        raise ValueError(f"--replicas {replicas} at --tp {args.tp} needs {replicas * args.tp} "
                         f"logical cores; {args.instance} has {cores}: give --replicas "
                         f"{cores // args.tp} or less, or more --instances")
    cfg = load_config(args.model)
    bad = problems(Layout(args.instance, "decode", tp=args.tp, dp=max(1, cores // args.tp),
                          micro_batch=args.batch, lnc=args.lnc), shape(cfg, 0))
    if bad:
        raise ValueError(bad[0])
    max_len = _max_len(args, trace.requests)
    if not any(r.prompt + r.output <= max_len for r in trace.requests):
        raise ValueError(f"no request of the trace fits --max-len {max_len} (prompt + output); "
                         "raise --max-len")
    steps, hbm, per_core = step_times(cfg, args.instance, args.tp, args.batch, max_len,
                                      args.lnc)
    minutes = args.compile_minutes or COMPILE_MINUTES
    total_replicas = replicas * args.instances
    f = fit(trace.requests, steps, max_len, args.max_graphs, minutes, total_replicas)
    usd, price_note = hourly_price(args.instance, args.price_per_hour)
    sides = {k: _capacity(trace.requests, r, steps, replicas, args.instances, usd, price_note)
             for k, r in (("plan", f.plan), ("baseline", f.baseline))}
    saturated = any(v["saturated"] for v in sides.values())
    total = sum(hbm.values())
    lo, hi = COMPILE_MINUTES_BAND
    warm = (f"given with --compile-minutes ({minutes:g} min per graph)"
            if args.compile_minutes else
            f"{minutes:.1f} min per graph, band {lo:g}-{hi:g} min; {COMPILE_SOURCES}")
    out: dict[str, Any] = {
        "setup": {"model": args.model, "instance": args.instance, "tp": args.tp,
                  "replicas_per_instance": replicas, "instances": args.instances,
                  "dispatch": "join-shortest-queue", "price_note": price_note,
                  "batch": args.batch, "max_len": max_len, "requests": len(trace.requests),
                  "trace_format": trace.source, "trace_note": trace.note,
                  "length_note": _position_note(cfg, max_len),
                  "candidates_simulated": f.candidates,
                  "hbm": {"weights": hbm.get("weights", 0.0),
                          "kv_cache": hbm.get("kv_cache", 0.0), "total": total,
                          "per_core": per_core, "fits": total <= per_core},
                  "estimates": (
                      "step times from neuronlocal estimate's roofline fitted to published "
                      f"Neuron benchmarks (prefill band x/÷{1 + band_width('prefill'):.2f}, "
                      f"decode x/÷{1 + band_width('decode'):.2f}; docs/estimate.md); "
                      "latencies and capacity from the queueing simulation "
                      "(docs/serving.md)"),
                  "warmup": warm},
        "plan": {**f.plan.as_dict(), **sides["plan"]},
        "baseline": {**f.baseline.as_dict(), **sides["baseline"]},
        "saturated": saturated,
        "dominates": f.dominates if not saturated else _dominates_unqueued(f, sides),
        "note": f.note if not saturated else (
            "arrivals exceed capacity, so p50/p99 latencies measure how long the trace is, not "
            "the plan: the plan and baseline are compared on graphs, padding and capacity "
            "only"),
        "configs": {"nxd_inference": configs.nxd_inference(f.plan.ctx, f.plan.tg, args.batch),
                    "vllm_neuron": configs.vllm_neuron(f.plan.ctx, f.plan.tg, args.batch),
                    "generate": configs.generate_snippet(f.plan.ctx, f.plan.tg)},
    }
    targets = _targets(args)
    if targets:
        from neuronlocal.serve.slo import search

        out["slo"] = search(trace.requests, cfg, args.instance, args.lnc, max_len,
                            args.max_graphs or f.baseline.graphs, targets,
                            args.max_instances, usd, price_note, minutes)
    if args.replay:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions",
                                                                          None)
        if limit and f.plan.tg[-1] > int(limit):
            raise ValueError(f"--replay: the plan's longest bucket {f.plan.tg[-1]} is over the "
                             f"model's {limit} positions; give --max-len {int(limit) // 128 * 128}"
                             " or less")
        out["_replay"] = (trace.requests[: args.replay], f.plan, steps)
    return out


def run(args: argparse.Namespace) -> int:
    from neuronlocal.estimate.workload import WorkloadError
    from neuronlocal.serve.trace import TraceError

    msg = _problem(args)
    if msg is None:
        try:
            out = plan(args)
        except (TraceError, WorkloadError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if msg is not None:
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if "_replay" in out:
        from neuronlocal.serve.replay import replay

        reqs, chosen, steps = out.pop("_replay")
        out["replay"] = replay(args.model, reqs, chosen.ctx, chosen.tg, steps)
    print(json.dumps(out, indent=1) if args.json else render(out))
    r = out.get("replay")
    if r is not None and (r["error"] or not r["requests"] or not r["outputs_match"]):
        why = r["error"] or ("no request fitted the plan's buckets" if not r["requests"]
                             else "outputs differ from the model on CPU")
        print(f"error: the replay failed: {why} ({r['requests']} of {len(reqs)} requests "
              "served)", file=sys.stderr)
        return 1
    return 0
