"""What code would cost on Trainium: step time, throughput and dollars, with error bars.

counting.py costs every ATen op (tensor-engine FLOPs, vector work, HBM bytes, collective
bytes); workload.py counts full-size transformers models on the meta device; roofline.py
turns counts into seconds with efficiency factors that calibrate.py fits to published
Neuron benchmarks (published.py, with sources; result in fitted.py); layout.py spreads a
workload over TP/PP/DP cores; graphs.py costs one captured FX graph; capture.py costs the
eager training steps of `neuronlocal run` and `neuronlocal check`, overlap.py the same steps
with the collectives that run alongside compute overlapped; cli.py is
`neuronlocal estimate`. Every estimate carries the band the held-out rows measured
(docs/estimate.md).
"""

from __future__ import annotations

from typing import Any

from neuronlocal.estimate.fitted import (
    BAND,
    BANDS,
    FACTORS,
    HELD_OUT_MEDIAN_ERROR,
    HELD_OUT_ROWS,
)
from neuronlocal.estimate.rates import InstanceSpec, instance, price

__all__ = ["BAND", "BANDS", "FACTORS", "HELD_OUT_MEDIAN_ERROR", "HELD_OUT_ROWS", "band",
           "band_width", "emulated", "estimate", "graph_cost", "graph_cost_later"]


MODE_METRIC = {"train": "seq_per_s", "prefill": "ttft_ms", "decode": "tpot_ms",
               "forward": "items_per_s"}


def band_width(mode: str | None = None) -> float:
    """The relative half-width of the band of an estimate of `mode` (None: any)."""
    return BANDS.get(MODE_METRIC.get(mode or "", ""), BAND)


def band(seconds: float, mode: str | None = None) -> tuple[float, float]:
    """(low, high) seconds: the range 80% of the held-out published rows of this kind of
    estimate (train, prefill, decode; None: all rows) fell in."""
    w = band_width(mode)
    return seconds / (1 + w), seconds * (1 + w)


def emulated() -> InstanceSpec:
    """The spec of the instance neuronlocal emulates (NEURONLOCAL_INSTANCE and LNC)."""
    from neuronlocal.core import state

    p = state.profile
    return instance(p.instance, p.lnc)


def graph_cost(gm: Any, example_inputs: list[Any], spec: InstanceSpec | None = None
               ) -> dict[str, Any]:
    """Estimated Trainium seconds of one call of an FX graph (forward and, when it will be
    differentiated, backward), per node, on one logical core of `spec` (default: the
    emulated instance), with its band."""
    from neuronlocal.estimate.graphs import graph_cost as _graph_cost

    return _graph_cost(gm, example_inputs, spec or emulated(), FACTORS, BAND)


def graph_cost_later(gm: Any, example_inputs: list[Any]) -> Any:
    """`graph_cost` of the graph as it is compiled now, computed when first called: the
    fake run costs seconds on a large graph, which a warm restart should not pay unless
    someone asks. Keeps fake copies of the inputs (no data) and the grad mode of now."""
    import torch

    from neuronlocal.estimate.graphs import fake_inputs

    fakes = fake_inputs(list(example_inputs))
    grad = torch.is_grad_enabled()

    def run() -> dict[str, Any]:
        from neuronlocal.estimate.graphs import graph_cost as _graph_cost

        with torch.set_grad_enabled(grad):
            return _graph_cost(gm, [], emulated(), FACTORS, BAND, fakes)

    return run


def estimate(model: Any, layout: Any, price_per_hour: float | None = None) -> Any:
    """The `layout.Estimate` of `model` (preset name, model type, config.json path or a
    transformers config) under `layout` (a `layout.Layout`)."""
    import torch

    from neuronlocal.estimate.layout import Estimate, Plan, memory, mfu, tokens_per_step
    from neuronlocal.estimate.workload import count, load_config

    cfg = load_config(model) if isinstance(model, str) else model
    lay = layout
    work = count(cfg, lay.mode, lay.micro_batch, 1 if lay.mode == "decode" else lay.seq,
                 lay.ctx, dtype=torch.float32 if lay.dtype == "fp32" else torch.bfloat16)
    plan = Plan(lay, work)
    b = plan.breakdown(FACTORS)
    p = price(lay.instance, price_per_hour)
    if p is None:
        note = f"no price known for {lay.instance}; give --price-per-hour"
    elif price_per_hour is not None:
        note = "price given with --price-per-hour"
    else:
        from neuronlocal.estimate.rates import PRICES_DATE, PRICES_REGION

        note = (f"{lay.instance} {PRICES_REGION}, table of {PRICES_DATE}"
                + ("" if p.verified else "; third-party figure, not confirmed by AWS"))
    return Estimate(lay, b.step, band(b.step, lay.mode), b.parts, tokens_per_step(lay),
                    mfu(plan, b.step), memory(lay, work), lay.spec.hbm_bytes,
                    p.usd_per_hour if p else None, note, work.shape.params,
                    eager_step(plan, lay.mode), plan.launches)


def eager_step(plan: Any, mode: str) -> tuple[float, float, float]:
    """(seconds, low, high) of a plan's step run eagerly: the band joins the calibrated
    band of the roofline with the assumed range of the per-launch cost."""
    from neuronlocal.estimate.roofline import eager_launch

    per, low, high = eager_launch(FACTORS)
    w = band_width(mode)
    return (plan.eager(FACTORS, per).step, plan.eager(FACTORS, low).step / (1 + w),
            plan.eager(FACTORS, high).step * (1 + w))
