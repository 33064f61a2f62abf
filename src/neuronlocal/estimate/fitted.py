"""Factors fitted by `python -m neuronlocal.estimate.calibrate --write` (generated)."""

from neuronlocal.estimate.roofline import Factors

FACTORS = Factors(
    tensor=0.9233961778053477,
    hbm=0.6076052448072063,
    vector=0.34202862425741226,
    fusion=0.9315542926843781,
    link=0.434497695681787,
    latency=6.171193574312554e-05,
    launch=0.0018596558847215371,
    train=1.5497898871457894,
)
HELD_OUT_MEDIAN_ERROR = 0.09164755071780262
BAND = 0.21964596978233808  # relative half-width covering 80% of held-out rows
# per estimate kind (the metric its held-out rows measure), never below BAND
BANDS = {
    'seq_per_s': 0.3448429126071044,
    'ttft_ms': 1.701321850635408,
    'tpot_ms': 0.21964596978233808,
    'items_per_s': 0.21964596978233808,
}
HELD_OUT_ROWS = 16
