"""A counted workload spread over cores: step time, throughput, MFU, HBM per core, cost.

Tensor parallelism (Megatron style, with sequence parallelism) divides every op of a layer
over `tp` cores and adds two all-reduce-sized exchanges of the activations per layer and
direction; pipeline parallelism gives each core `1/pp` of the layers and a (pp - 1)
micro-batch bubble; data parallelism reduces gradients once per step (ZeRO-1: optimizer
state sharded) or, as FSDP (`zero=3`), gathers weights and scatters gradients every
micro-batch, overlapped with compute. Inference shards the same way over `tp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from neuronlocal.core.topology import link_class
from neuronlocal.estimate.counting import OpCost, Tally
from neuronlocal.estimate.rates import InstanceSpec, instance
from neuronlocal.estimate.roofline import (
    Compiled,
    Factors,
    eager_factors,
    launches,
    link_bandwidth,
)
from neuronlocal.estimate.workload import Shape, Workload

MODES = ("train", "prefill", "decode", "forward")


@dataclass(frozen=True)
class Layout:
    instance: str
    mode: str = "train"
    nodes: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None  # sequences per optimizer step (default micro x dp)
    seq: int = 2048  # tokens per sequence (prompt length for prefill)
    ctx: int = 0  # cached tokens a decode step attends to
    zero: int = 1  # 1: optimizer state sharded over dp; 3: FSDP (weights and grads too)
    dtype: str = "bf16"
    checkpointing: bool = False  # recompute activations in the backward pass
    lnc: int | None = None

    @property
    def spec(self) -> InstanceSpec:
        return instance(self.instance, self.lnc)

    @property
    def batch(self) -> int:
        return self.global_batch or self.micro_batch * self.dp

    @property
    def micro_steps(self) -> int:
        return max(1, self.batch // (self.micro_batch * self.dp))


def problems(layout: Layout, shape: Shape | None = None) -> list[str]:
    """Why a layout cannot run (empty when it can): the CLI exits 2 naming each."""
    out = []
    try:
        spec = layout.spec
    except KeyError as e:
        return [str(e.args[0])]
    if layout.mode not in MODES:
        out.append(f"mode {layout.mode!r} is not one of {', '.join(MODES)}")
    if min(layout.nodes, layout.tp, layout.pp, layout.dp, layout.micro_batch) < 1:
        out.append("--nodes, --tp, --pp, --dp and --batch must be at least 1")
        return out
    cores = spec.cores * layout.nodes
    used = layout.tp * layout.pp * layout.dp
    if used > cores:
        out.append(f"tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp} = {used} cores, but "
                   f"{layout.nodes} x {layout.instance} (LNC={spec.lnc}) has {cores} logical "
                   f"cores; make the product at most {cores} (or add --nodes)")
    elif used <= spec.cores * (layout.nodes - 1):
        out.append(f"tp*pp*dp = {used} cores fit on fewer than {layout.nodes} x "
                   f"{layout.instance}; use --nodes {math.ceil(used / spec.cores)}")
    if layout.nodes > 1 and not spec.net_bytes_per_s:
        out.append(f"{layout.instance} has no published EFA bandwidth; use --nodes 1")
    if layout.batch % (layout.micro_batch * layout.dp):
        out.append(f"global batch {layout.batch} is not a multiple of batch x dp = "
                   f"{layout.micro_batch * layout.dp}")
    if layout.mode != "train" and layout.pp > 1:
        out.append("pipeline parallelism is estimated for training only; use --pp 1")
    if shape is not None:
        if shape.heads % layout.tp:
            out.append(f"{shape.heads} attention heads are not divisible by tp={layout.tp}")
        elif not tp_allowed(shape.heads, shape.kv_heads, layout.tp):
            out.append(f"{shape.kv_heads} key/value heads neither divide nor are divided by "
                       f"tp={layout.tp}")
        if shape.layers % layout.pp:
            out.append(f"{shape.layers} layers are not divisible by pp={layout.pp}")
    return out


def tp_allowed(heads: int, kv_heads: int, tp: int) -> bool:
    """Whether the model's attention splits over `tp` cores: whole query heads per core,
    and key/value heads either split or replicated evenly."""
    return heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)


def idle_cores(layout: Layout) -> int:
    """Logical cores of the instance(s) the layout leaves to other work (a layout may use
    part of an instance, as TP=4 x FSDP=8 on 32 of a trn2.48xlarge's 64)."""
    return max(0, layout.spec.cores * layout.nodes - layout.tp * layout.pp * layout.dp)


def _kv_sharded(tally: Tally, tp: int, kv_heads: int) -> Tally:
    """Attention reads whole K/V heads: with more cores than K/V heads they are replicated."""
    shards = min(tp, max(kv_heads, 1))
    if shards == tp:
        return tally
    out = Tally()
    for op, n in tally.ops.items():
        if op.engine == "tensor" and op.vector:
            op = op._replace(bytes=op.bytes * tp / shards)
        out.add(op, n)
    return out


@dataclass
class Breakdown:
    step: float
    parts: dict[str, float] = field(default_factory=dict)


class Plan:
    """A workload under a layout, compiled once; `breakdown(factors)` is cheap."""

    def __init__(self, layout: Layout, work: Workload) -> None:
        self.layout, self.work = layout, work
        spec, lay, sh = layout.spec, layout, work.shape
        tally = Tally()
        tally.merge(work.forward)
        tally.merge(work.backward)
        if lay.checkpointing and lay.mode == "train":
            tally.merge(work.forward)
        tally = _kv_sharded(tally, lay.tp, sh.kv_heads)
        self.compute = Compiled(tally, spec)
        self.launches = launches(tally) / lay.pp  # eager kernel launches per core, micro-batch
        self.model_flops = work.forward.tensor_flops + work.backward.tensor_flops
        elem = 4 if lay.dtype == "fp32" else 2
        tokens = lay.micro_batch * (1 if lay.mode == "decode" else lay.seq)
        act = tokens * sh.hidden * elem  # one activation tensor of the micro-batch
        layers = sh.layers / lay.pp
        per_layer = 4 if lay.mode == "train" else 2
        self.tp_count = per_layer * layers if lay.tp > 1 else 0.0
        self.tp_bytes = self.tp_count * 2 * (lay.tp - 1) / lay.tp * act
        ranks_node = spec.cores
        # Rank 0's groups: TP over consecutive ranks, data parallel strided by tp * pp.
        self.tp_bw = link_bandwidth(
            spec, link_class(range(lay.tp), spec.cores_per_chip, ranks_node), ranks_node)
        shard = sh.params / (lay.tp * lay.pp)  # parameters one core updates (before dp)
        self.dp_bytes = self.dp_count = self.fsdp_bytes = self.fsdp_count = self.fsdp_net = 0.0
        self.dp_bw = self.net_bytes = 0.0
        if lay.mode == "train" and lay.dp > 1:
            d = lay.dp
            if lay.zero >= 3:  # all-gather weights twice, reduce-scatter grads, per micro-batch
                self.fsdp_bytes = 3 * (d - 1) / d * shard * 2
                self.fsdp_count = 3 * layers
            local = max(1, min(d, spec.cores // (lay.tp * lay.pp)))
            stride = lay.tp * lay.pp
            self.dp_bw = link_bandwidth(spec, link_class(
                range(0, stride * local, stride), spec.cores_per_chip, ranks_node), ranks_node)
            nodes = d // local
            if lay.zero < 3:  # one gradient reduction per step (FSDP's is per micro-batch)
                self.dp_bytes = 2 * (local - 1) / local * shard * 4
                self.dp_count = 2.0
                if nodes > 1:  # hierarchical: the whole replica's gradients cross EFA
                    self.net_bytes = 2 * (nodes - 1) / nodes * sh.params * 4
            elif nodes > 1:  # FSDP over instances: each gathers and scatters a full replica
                self.fsdp_net = 3 * (nodes - 1) / nodes * sh.params * 2
        states = 16 if lay.dtype == "bf16" else 12  # fp32 master + moments (+ bf16 copy)
        opt_shard = shard / (lay.dp if lay.zero >= 1 else 1)
        self.opt_bytes = 2 * states * opt_shard if lay.mode == "train" else 0.0

    def breakdown(self, f: Factors) -> Breakdown:
        lay, spec = self.layout, self.layout.spec
        compute = self.compute.seconds(f) / (lay.tp * lay.pp)
        tp = self.tp_count * f.latency + self.tp_bytes / (self.tp_bw * f.link)
        if lay.mode != "train":
            step = compute + tp + f.launch
            return Breakdown(step, {"compute": compute, "tensor_parallel": tp,
                                    "launch": f.launch})
        compute *= f.train
        micro = compute
        if self.fsdp_bytes:
            fsdp = self.fsdp_count * f.latency + self.fsdp_bytes / (self.dp_bw * f.link)
            if self.fsdp_net:
                fsdp += self.fsdp_net / (spec.net_bytes_per_s * f.link)
            micro = max(compute, fsdp)
        micro += tp + f.launch
        pipe = (lay.micro_steps + lay.pp - 1) * micro
        dp = self.dp_count * f.latency + self.dp_bytes / (self.dp_bw * f.link) if \
            self.dp_bytes else 0.0
        if self.net_bytes:
            dp += self.net_bytes / (spec.net_bytes_per_s * f.link)
        opt = self.opt_bytes / (spec.hbm_bytes_per_s * f.hbm)
        return Breakdown(pipe + dp + opt, {
            "compute": compute * lay.micro_steps, "tensor_parallel": tp * lay.micro_steps,
            "pipeline_bubble": (lay.pp - 1) * micro, "launch": f.launch * lay.micro_steps,
            "data_parallel": dp, "optimizer": opt, "fsdp_exposed": (micro - compute - tp -
                                                                   f.launch) *
            lay.micro_steps})


    def eager(self, f: Factors, per_launch: float) -> Breakdown:
        """The step run eagerly, as TorchNeuron's eager mode runs it: ops one at a time (no
        fusion), each its own kernel launch of `per_launch` seconds, instead of one graph
        launch per micro-batch."""
        b = self.breakdown(replace(eager_factors(f), launch=self.launches * per_launch))
        b.parts["eager_launches"] = b.parts.pop("launch")
        return b


def memory(layout: Layout, work: Workload) -> dict[str, float]:
    """HBM bytes one core holds: weights, gradients, optimizer state, activations, KV cache."""
    lay, sh = layout, work.shape
    shard = sh.params / (lay.tp * lay.pp)
    elem = 4 if lay.dtype == "fp32" else 2
    out: dict[str, float] = {}
    if lay.mode == "train":
        fsdp = lay.dp if lay.zero >= 3 else 1
        out["weights"] = shard * elem / fsdp
        out["gradients"] = shard * 4 / fsdp
        out["optimizer"] = shard * (12 if elem == 2 else 8) / (lay.dp if lay.zero >= 1 else 1)
        act = work.activation_bytes / lay.tp  # 1F1B: the first stage holds pp micro-batches
        if lay.checkpointing:
            act = (lay.micro_batch * lay.seq * sh.hidden * elem * sh.layers
                   + work.activation_bytes / sh.layers) / lay.tp
        out["activations"] = act
    else:
        out["weights"] = shard * elem
        if lay.mode == "decode":
            out["kv_cache"] = work.activation_bytes / min(lay.tp, max(sh.kv_heads, 1))
    return out


@dataclass
class Estimate:
    """One estimate with its band; `band` is (low, high) seconds of the step."""

    layout: Layout
    step: float
    band: tuple[float, float]
    parts: dict[str, float]
    tokens_per_step: float
    mfu: float
    hbm: dict[str, float]
    hbm_per_core: int
    usd_per_hour: float | None
    price_note: str
    params: int = 0
    # run eagerly (one kernel launch per op): step seconds, its band, launches per core
    eager: tuple[float, float, float] | None = None
    launches: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step

    @property
    def fits(self) -> bool:
        return sum(self.hbm.values()) <= self.hbm_per_core

    def usd_per_million_tokens(self) -> tuple[float, float, float] | None:
        if self.usd_per_hour is None:
            return None
        rate = self.usd_per_hour * self.layout.nodes / 3600 * 1e6 / self.tokens_per_step
        return rate * self.step, rate * self.band[0], rate * self.band[1]

    def as_dict(self) -> dict[str, Any]:
        cost = self.usd_per_million_tokens()
        return {"layout": self.layout.__dict__, "step_s": self.step, "band_s": self.band,
                "parts_s": self.parts, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "hbm_bytes": self.hbm, "hbm_per_core": self.hbm_per_core, "fits": self.fits,
                "usd_per_hour": self.usd_per_hour, "price_note": self.price_note,
                "usd_per_million_tokens": cost, "params": self.params,
                "eager_step_s": self.eager[0] if self.eager else None,
                "eager_band_s": list(self.eager[1:]) if self.eager else None,
                "eager_launches_per_core": self.launches,
                "idle_cores": idle_cores(self.layout)}


def tokens_per_step(layout: Layout) -> float:
    if layout.mode == "decode":
        return layout.micro_batch * layout.dp
    if layout.mode == "train":
        return layout.batch * layout.seq
    return layout.micro_batch * layout.dp * layout.seq


def mfu(plan: Plan, step: float) -> float:
    """Model FLOPs (counted, no recompute) over the peak of every core for one step."""
    lay, spec = plan.layout, plan.layout.spec
    peak = spec.tensor_flops(lay.dtype) * spec.cores * lay.nodes
    flops = plan.model_flops * (lay.micro_steps * lay.dp if lay.mode == "train" else lay.dp)
    return flops / (peak * step) if step > 0 and not math.isnan(step) else 0.0


__all__ = ["Breakdown", "Estimate", "Layout", "OpCost", "Plan", "memory", "mfu", "problems",
           "tokens_per_step"]
