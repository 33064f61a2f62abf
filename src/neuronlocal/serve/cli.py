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
MAX_COMPILE_MINUTES, MAX_REPLAY = 10**4, 10**4
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def _problem(args: argparse.Namespace) -> str | None:
    checks = [
        (not 1 <= args.batch <= MAX_BATCH, f"--batch is {args.batch}; give 1 to {MAX_BATCH}"),
        (not 1 <= args.tp <= MAX_TP, f"--tp is {args.tp}; give 1 to {MAX_TP}"),
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
    from neuronlocal.serve.plan import round_up

    if args.max_len is not None:
        return int(args.max_len)
    return round_up(max(r.prompt + r.output for r in requests))


def _position_note(cfg: Any, max_len: int) -> str:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if limit and max_len > int(limit):
        return (f"max length {max_len} is over the config's max_position_embeddings {limit} "
                "(a preset or model type gets transformers' default); check the real model's "
                "limit or give --max-len")
    return ""


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.1f} ms" if v < 1e4 else f"{v / 1e3:.2f} s")


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


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
        *((f"{k.split('_')[0].upper()} p50 / p99", *(f"{_ms(r[k]['p50'])} / "
                                                   f"{_ms(r[k]['p99'])}" for r in (p, b)))
          for k in ("ttft_ms", "tpot_ms")),
        ("unservable requests", str(p["unservable"]), str(b["unservable"])),
        ("cost (docs/serving.md)", f"{p['cost']:.4f}", f"{b['cost']:.4f}"),
    ]
    w = max(len(r[1]) for r in rows) + 2
    lines = [f"{m['model']}: {m['requests']:,} requests ({m['trace_format']}), one replica of "
             f"TP={m['tp']} on {m['instance']}, batch {m['batch']}, max length "
             f"{m['max_len']}", ""]
    lines.append(f"{'':26}{'plan':{w}}baseline (powers of two from 128)")
    lines += [f"{name:26}{a:{w}}{c}" for name, a, c in rows]
    h = m["hbm"]
    lines += ["", f"HBM per core: weights {fmt_bytes(h['weights'])} + KV cache "
              f"{fmt_bytes(h['kv_cache'])} at {m['max_len']} tokens x batch {m['batch']} = "
              f"{fmt_bytes(h['total'])} of {fmt_bytes(h['per_core'])} "
              f"({'fits' if h['fits'] else 'DOES NOT FIT'})"]
    if not out["dominates"]:
        lines.append(f"note: {out['note']}")
    lines += [f"note: {m[k]}" for k in ("trace_note", "length_note") if m.get(k)]
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
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan as plain data; raises TraceError, WorkloadError or ValueError on bad input."""
    from neuronlocal.estimate import band_width
    from neuronlocal.estimate.layout import Layout, problems
    from neuronlocal.estimate.rates import instance
    from neuronlocal.estimate.workload import load_config, shape
    from neuronlocal.serve import configs
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
    f = fit(trace.requests, steps, max_len, args.max_graphs, minutes)
    total = sum(hbm.values())
    lo, hi = COMPILE_MINUTES_BAND
    warm = (f"given with --compile-minutes ({minutes:g} min per graph)"
            if args.compile_minutes else
            f"{minutes:.1f} min per graph, band {lo:g}-{hi:g} min; {COMPILE_SOURCES}")
    out: dict[str, Any] = {
        "setup": {"model": args.model, "instance": args.instance, "tp": args.tp,
                  "batch": args.batch, "max_len": max_len, "requests": len(trace.requests),
                  "trace_format": trace.source, "trace_note": trace.note,
                  "length_note": "" if args.max_len else _position_note(cfg, max_len),
                  "candidates_simulated": f.candidates,
                  "hbm": {"weights": hbm.get("weights", 0.0),
                          "kv_cache": hbm.get("kv_cache", 0.0), "total": total,
                          "per_core": per_core, "fits": total <= per_core},
                  "estimates": (
                      "step times from neuronlocal estimate's roofline fitted to published "
                      f"Neuron benchmarks (prefill band x/÷{1 + band_width('prefill'):.2f}, "
                      f"decode x/÷{1 + band_width('decode'):.2f}; docs/estimate.md); "
                      "latencies from the queueing simulation (docs/serving.md)"),
                  "warmup": warm},
        "plan": f.plan.as_dict(), "baseline": f.baseline.as_dict(),
        "dominates": f.dominates, "note": f.note,
        "configs": {"nxd_inference": configs.nxd_inference(f.plan.ctx, f.plan.tg, args.batch),
                    "vllm_neuron": configs.vllm_neuron(f.plan.ctx, f.plan.tg, args.batch),
                    "generate": configs.generate_snippet(f.plan.ctx, f.plan.tg)},
    }
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
