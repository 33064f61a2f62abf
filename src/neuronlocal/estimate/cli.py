"""`neuronlocal estimate`: a full-size model's step time, throughput and cost, with its band.

Nothing is allocated: the model is counted on the meta device. Exit status 0 with an
estimate, 2 on bad input or an impossible layout (each problem named).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from neuronlocal.core.options import amount, whole

GIB = 2**30
MAX_TOKENS = 2**24  # tokens per sequence or sequences per batch: past any real model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a preset (e.g. llama-3.1-8b), a transformers model type "
                                 "(e.g. llama), or a config.json path")
    p.add_argument("--instance", default="trn2.48xlarge", help="default trn2.48xlarge")
    p.add_argument("--lnc", type=int, choices=(1, 2), help="logical core size (Trn2/Trn3)")
    p.add_argument("--nodes", type=whole(1, 2**16), default=1)
    p.add_argument("--tp", type=whole(), default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=whole(), default=1, help="pipeline-parallel degree (training)")
    p.add_argument("--dp", type=whole(), help="data-parallel degree (default: cores/(tp*pp))")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights and gradients over dp too (FSDP / ZeRO-3)")
    p.add_argument("--seq", type=whole(1, MAX_TOKENS), default=2048,
                   help="tokens per sequence (prompt)")
    p.add_argument("--batch", type=whole(1, MAX_TOKENS), default=1,
                   help="sequences per core group per step (micro-batch)")
    p.add_argument("--global-batch", type=whole(1, MAX_TOKENS), help="sequences per optimizer step")
    p.add_argument("--mode", choices=("train", "prefill", "decode"), default="train",
                   help="train (forward, backward, optimizer), prefill, or one decode step")
    p.add_argument("--ctx", type=whole(0, MAX_TOKENS),
                   help="tokens in the KV cache for decode (default --seq)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--checkpointing", action="store_true",
                   help="recompute activations in the backward pass")
    p.add_argument("--price-per-hour", type=amount(0, 1e6), help="USD per instance-hour (overrides "
                                                        "the price table)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _layout(args: argparse.Namespace) -> tuple[Any, list[str]]:
    from neuronlocal.estimate.layout import Layout
    from neuronlocal.estimate.rates import instance

    try:
        spec = instance(args.instance, args.lnc)
    except KeyError as e:
        return None, [str(e.args[0])]
    dp = args.dp
    if dp is None:
        cores = spec.cores * args.nodes
        dp = max(1, cores // max(1, args.tp * args.pp))
    ctx = args.ctx if args.ctx is not None else args.seq
    return Layout(args.instance, args.mode, args.nodes, args.tp, args.pp, dp, args.batch,
                  args.global_batch, args.seq, ctx, 3 if args.fsdp else 1, args.dtype,
                  args.checkpointing, args.lnc), []


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _eager_lines(est: Any) -> list[str]:
    """The eager-mode step next to the compiled one (which the other lines describe)."""
    if not est.eager:
        return []
    from neuronlocal.estimate import FACTORS
    from neuronlocal.estimate.roofline import eager_launch

    per, low, high = eager_launch(FACTORS)
    step, lo, hi = est.eager
    return [f"eager step    {_fmt_s(step)}   band {_fmt_s(lo)} - {_fmt_s(hi)} without "
            f"torch.compile: {est.launches:,.0f} kernel launches per core and micro-batch at "
            f"an assumed {per * 1e6:.0f} us each (range {low * 1e6:.0f} us - "
            f"{high * 1e3:.2f} ms; no published per-launch figure exists); the step time "
            "above and the lines below are compiled"]


def render(est: Any, model: str) -> str:
    from neuronlocal.estimate import HELD_OUT_MEDIAN_ERROR, HELD_OUT_ROWS, band_width
    from neuronlocal.estimate.layout import idle_cores

    lay, spec = est.layout, est.layout.spec
    lo, hi = est.band
    par = [f"TP={lay.tp}"] + ([f"PP={lay.pp}"] if lay.pp > 1 else []) + [
        f"DP={lay.dp}" + (" (FSDP)" if lay.zero >= 3 else "")]
    what = {"train": "training step", "prefill": "prefill", "decode": "decode step"}[lay.mode]
    lines = [
        f"{model}: {est.params / 1e9:.2f}B parameters, {what} on {lay.nodes} x {lay.instance} "
        f"(LNC={spec.lnc}, {spec.cores * lay.nodes} logical cores)",
        f"layout        {' x '.join(par)}, micro-batch {lay.micro_batch}"
        + (f", global batch {lay.batch}, {lay.micro_steps} micro-step(s)" if lay.mode == "train"
           else "") + (f", context {lay.ctx}" if lay.mode == "decode" else
                       f", sequence {lay.seq}") + (", activation checkpointing"
                                                   if lay.checkpointing else ""),
        f"step time     {_fmt_s(est.step)}   band {_fmt_s(lo)} - {_fmt_s(hi)} "
        f"(x/÷{1 + band_width(lay.mode):.2f}: 80% of the held-out published {lay.mode} rows "
        "fell within it)",
        *_eager_lines(est),
        f"tokens/s      {est.tokens_per_s:,.0f}   band {est.tokens_per_step / hi:,.0f} - "
        f"{est.tokens_per_step / lo:,.0f}",
        f"MFU           {100 * est.mfu:.1f}% of dense {lay.dtype.upper()} peak",
    ]
    idle = idle_cores(lay)
    if idle:
        total = spec.cores * lay.nodes
        lines.append(f"instance      uses {total - idle} of {total} logical cores; the other "
                     f"{idle} are free for other jobs (cost below counts the whole instance; "
                     f"--dp {total // (lay.tp * lay.pp)} would use them all)")
    used = sum(est.hbm.values())
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.hbm.items())
    lines.append(f"HBM per core  {used / GIB:.2f} GiB of {est.hbm_per_core / GIB:.1f} GiB -> "
                 f"{'fits' if est.fits else 'DOES NOT FIT'} ({parts} GiB)")
    cost = est.usd_per_million_tokens()
    if cost is None:
        lines.append(f"cost          unknown: {est.price_note}")
    else:
        lines.append(f"cost          ${cost[0]:.3f} per million tokens (band ${cost[1]:.3f} - "
                     f"${cost[2]:.3f}) at ${est.usd_per_hour:.2f}/h per instance "
                     f"({est.price_note})")
    lines.append("breakdown     " + ", ".join(f"{k.replace('_', ' ')} {_fmt_s(v)}"
                                              for k, v in est.parts.items() if v > 1e-6))
    lines.append(f"calibration   median error {100 * HELD_OUT_MEDIAN_ERROR:.1f}% on "
                 f"{HELD_OUT_ROWS} held-out published rows (Trn1/Inf2/Trn2, Neuron SDK "
                 "stacks, not TorchNeuron itself); see docs/estimate.md")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from neuronlocal.estimate import estimate
    from neuronlocal.estimate.layout import problems
    from neuronlocal.estimate.workload import WorkloadError, load_config, shape

    lay, errs = _layout(args)
    try:
        cfg = load_config(args.model)
    except WorkloadError as e:
        errs.append(str(e))
        cfg = None
    if lay is not None and cfg is not None:
        errs += problems(lay, shape(cfg, 0))
    if errs:
        print(f"error: {'; '.join(errs)}", file=sys.stderr)
        return 2
    try:
        est = estimate(cfg, lay, args.price_per_hour)
    except WorkloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, **est.as_dict()}, indent=1, default=str))
    else:
        print(render(est, args.model))
    return 0


def check_line(cfg: Any, tp: int | None, instance_name: str = "trn2.48xlarge",
               fsdp: bool = False) -> str:
    """One line for `neuronlocal check`: a full-size training step at the smallest TP that
    fits, data parallel (FSDP with `fsdp`) over the rest of the instance, sequence up to
    4096."""
    from neuronlocal.estimate import estimate
    from neuronlocal.estimate.layout import Layout, problems
    from neuronlocal.estimate.rates import instance
    from neuronlocal.estimate.workload import WorkloadError, shape

    if tp is None:
        return f"  estimated training step on {instance_name}: does not fit at any TP"
    cores = instance(instance_name).cores
    seq = min(4096, int(getattr(cfg, "max_position_embeddings", 4096) or 4096))
    lay = Layout(instance_name, "train", tp=tp, dp=cores // tp, seq=seq, zero=3 if fsdp else 1)
    bad = problems(lay, shape(cfg, 0))
    if bad:
        return f"  estimated training step on {instance_name}: not estimated ({bad[0]})"
    try:
        est = estimate(cfg, lay)
    except WorkloadError as e:
        return f"  estimated training step on {instance_name}: not estimated ({e})"
    cost = est.usd_per_million_tokens()
    money = "" if cost is None else (
        f", ${cost[0]:.3g} per million tokens" + ("" if "not confirmed" not in est.price_note
                                                  else " (unverified price)"))
    return (f"  estimated training step on {instance_name} (TP={tp} x "
            f"{'FSDP' if fsdp else 'DP'}={cores // tp}, "
            f"sequence {seq}, micro-batch 1): {_fmt_s(est.step)} (band {_fmt_s(est.band[0])} - "
            f"{_fmt_s(est.band[1])}), {est.tokens_per_s:,.0f} tokens/s{money}"
            + (f"; eager (no torch.compile, one kernel launch per op at an assumed cost): "
               f"{_fmt_s(est.eager[0])} (band {_fmt_s(est.eager[1])} - {_fmt_s(est.eager[2])})"
               if est.eager else ""))
