"""What a dry-run job would cost: step time, tokens/s, MFU, dollars, and the compile bill.

Nothing here prices an op: the step time is the run report's own estimate of each
simulated rank's steps (estimate/capture.py: the calibrated roofline over the eager ops the
rank ran, their collectives at latency + bytes over the link, one kernel launch per eager
op, and each compiled graph's estimate with its launch); the collectives table prices each
(op, group) with the same ring-byte rule and link rates (counting.collective_cost,
roofline.link_bandwidth, the fitted factors); the compile bill takes the serve plan's
minutes per graph and band. This module joins them over the ranks and states what each
number assumes.
"""

from __future__ import annotations

from typing import Any

from neuronlocal.estimate import FACTORS, band_width
from neuronlocal.estimate.counting import collective_cost
from neuronlocal.estimate.rates import PRICES_DATE, InstanceSpec, instance, price
from neuronlocal.estimate.roofline import eager_launch, link_bandwidth
from neuronlocal.serve.plan import COMPILE_MINUTES, COMPILE_MINUTES_BAND, COMPILE_SOURCES

OVERLAP_ASSUMPTION = (
    "step_overlapped_s: the same ops in the order issued, on a compute stream and one link "
    "that carries every collective in turn. FSDP's all-gathers and reduce-scatters, DDP's "
    "gradient buckets (async_op) and collectives issued on a non-default stream run "
    "alongside compute: compute waits for an all-gather when the next one is issued (each "
    "layer takes the longer of its compute and its gather; the first gather of a pass, "
    "exposed on the hardware, is not), and for reductions when the optimizer step begins. "
    "Tensor parallelism's collectives (DTensor, functional collectives) and synchronous "
    "calls are waited for where issued: on the critical path. An assumption: no published "
    "figure says how much TorchNeuron's runtime overlaps (in its default single-stream "
    "mode FSDP's streams are the default stream). The band runs from the overlapped "
    "figure's low end to the serial figure's high end")


def _input_bytes(op: str, result_bytes: float, group: int) -> float:
    """A collective's input bytes from its result's (what the dry run records): a gather's
    result is the group's inputs together, a reduce-scatter's one share of its input."""
    if "gather" in op:
        return result_bytes / max(1, group)
    if "reduce_scatter" in op:
        return result_bytes * group
    return result_bytes


def collective_seconds(op: str, group: int, link: str, result_bytes: float, calls: int,
                       spec: InstanceSpec, ranks_per_node: int) -> float:
    """Seconds of `calls` collectives moving `result_bytes` in all, priced as the roofline
    prices one (its latency, plus the ring bytes over the group's link at the fitted link
    efficiency), on `link`, the class of the group's member ranks."""
    if group <= 1 or calls <= 0:
        return 0.0
    sent = collective_cost(op, _input_bytes(op, result_bytes, group), group).comm_bytes
    bw = link_bandwidth(spec, link, ranks_per_node)
    return calls * FACTORS.latency + sent / (bw * FACTORS.link)


def _steady(rep: dict[str, Any]) -> dict[str, Any] | None:
    """The last step the rank's estimate recorded (the first of a run compiles)."""
    steps = (rep.get("estimate") or {}).get("steps") or []
    return steps[-1] if steps else None


def _unique_graphs(reps: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """(graphs across the ranks counted once by their compile cache key, graphs per rank):
    ranks that trace the same graph share its compiled artifact."""
    keys: set[Any] = set()
    per_rank = []
    for r in reps:
        graphs = r.get("graphs") or []
        per_rank.append(len(graphs))
        for g in graphs:
            keys.add(g.get("cache_key") or (g["graph_name"], str(g["input_shapes"]),
                                            str(g["input_dtypes"])))
    return len(keys), per_rank


def compile_bill(reps: list[dict[str, Any]]) -> dict[str, Any]:
    graphs, per_rank = _unique_graphs(reps)
    lo, hi = COMPILE_MINUTES_BAND
    return {"graphs": graphs, "graphs_per_rank": per_rank,
            "compile_s": graphs * COMPILE_MINUTES * 60,
            "compile_band_s": [graphs * lo * 60, graphs * hi * 60],
            "compile_minutes_per_graph": COMPILE_MINUTES}


def cost(reps: list[dict[str, Any]], world: int, nnodes: int, spec: InstanceSpec,
         tokens_per_step: int | None = None) -> dict[str, Any]:
    """The priced part of the `dry_run` section: step time and band, tokens/s, MFU, $."""
    w = band_width("train")
    per, low, high = eager_launch(FACTORS)
    out: dict[str, Any] = {"step_s": None, "step_overlapped_s": None,
                           "collectives_alongside_s": None, "step_band_s": None,
                           "tokens_per_step": None,
                           "tokens_per_s": None, "mfu": None, "usd_per_million_tokens": None}
    steps = [(r["rank"], s) for r in reps if (s := _steady(r)) is not None]
    assumptions = [
        f"step_s: the calibrated roofline over the ops each rank ran in its last step "
        f"(the run report's estimate), the slowest simulated rank's; band: the held-out "
        f"rows' +/-{w:.0%} for training steps",
        "collectives: a fixed latency each plus ring bytes over their link (the chip's HBM "
        "within a chip, NeuronLink between chips, EFA between instances); step_s adds them "
        "to compute (serial)",
        OVERLAP_ASSUMPTION,
        f"launches: each compiled graph's fitted launch ({FACTORS.launch * 1e3:.2f} ms "
        f"per call); each eager op its own kernel launch of {per * 1e6:.0f} us, an "
        f"assumption: no published per-op figure exists (range {low * 1e6:.0f} us - "
        f"{high * 1e3:.2f} ms, in the band)",
    ]
    missing: list[str] = []
    if not steps:
        missing.append("step time: no optimizer step was recorded (the estimate cuts the "
                       "run into steps at optimizer.step())")
        return {**out, "step_parts_s": None, "assumptions": assumptions, "missing": missing}
    rank, s = max(steps, key=lambda rs: rs[1]["estimated_s"])
    step = float(s["estimated_s"])
    comm = float(s.get("comm_s", 0.0))
    lo, hi = s["band_s"]
    lapped = float(s.get("overlapped_s", step))
    band = [min(lo, s.get("overlapped_band_s", [lo])[0]), hi]  # covers both figures
    out.update(step_s=step, step_overlapped_s=lapped,
               collectives_alongside_s=float(s.get("comm_alongside_s", 0.0)),
               step_band_s=band, step_rank=rank)
    parts = {"eager_compute": s["eager_s"] - s["launch_s"] - comm, "collectives": comm,
             "eager_launches": s["launch_s"], "compiled_graphs": s["graph_s"]}
    tokens = tokens_per_step
    if tokens is None:
        fed, shared = int(s.get("tokens", 0)), int(s.get("token_sharers", 1))
        if fed:
            tokens = fed * world // shared
            why = (f" / {shared} ranks that looked up the same tokens (the tensor-parallel "
                   "mesh over which the embedding's indices are replicated)" if shared > 1
                   else ", every rank its own batch (the embedding's indices are not "
                   "replicated over a device mesh)")
            assumptions.append(
                f"tokens per step: {fed} per rank (the largest index tensor an embedding "
                f"looked up in rank {rank}'s last step) x {world} ranks{why}; pipeline "
                "stages that share a batch are not detected: give --tokens-per-step")
        else:
            missing.append("tokens/s and $ per million tokens: no embedding lookup was seen; "
                           "give --tokens-per-step")
    else:
        assumptions.append(f"tokens per step: {tokens}, given with --tokens-per-step")
    flops = float(s.get("tensor_flops", 0.0))
    peak = spec.tensor_flops("bf16")
    out["mfu"] = flops / (peak * step) if step > 0 else None
    assumptions.append("mfu: tensor-engine FLOPs counted in the step on the slowest rank "
                       "(recomputation included) over one logical core's BF16 peak for "
                       "step_s")
    p = price(spec.name)
    out["usd_per_hour"] = p.usd_per_hour * nnodes if p else None
    if tokens:
        out["tokens_per_step"] = tokens
        out["tokens_per_s"] = tokens / step
        if p is not None:
            rate = p.usd_per_hour * nnodes / 3600 * 1e6 / tokens
            out["usd_per_million_tokens"] = [rate * step, rate * band[0], rate * band[1]]
            assumptions.append(
                f"$: {nnodes} x {spec.name} at ${p.usd_per_hour:.2f}/h on demand (table of "
                f"{PRICES_DATE}" + ("" if p.verified else "; third-party figure, not "
                                    "confirmed by AWS") + ")")
    if p is None:
        missing.append(f"$: no price known for {spec.name}")
    return {**out, "step_parts_s": parts, "assumptions": assumptions, "missing": missing}


def priced_collectives(colls: list[dict[str, Any]], steps: int, spec: InstanceSpec,
                       ranks_per_node: int) -> list[dict[str, Any]]:
    """The collectives table with each row's estimated seconds per step."""
    return [{**c, "seconds_per_step": collective_seconds(
        c["op"], c["group_size"], c["link"], c["bytes"], c["calls"], spec, ranks_per_node)
        / max(1, steps)} for c in colls]


def compile_assumption() -> str:
    lo, hi = COMPILE_MINUTES_BAND
    return (f"compile_s: unique graphs across the simulated ranks (one compiled artifact "
            f"per cache key, shared by the ranks) x {COMPILE_MINUTES:.1f} min per graph, "
            f"band {lo:g}-{hi:g} min, compiled one after another; {COMPILE_SOURCES}")


def spec_of(instance_name: str, lnc: int) -> InstanceSpec:
    return instance(instance_name, lnc)
