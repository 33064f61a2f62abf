"""Counted work -> seconds on one NeuronCore: a roofline with calibrated efficiency factors.

Each op takes the longest of its tensor-engine time, its vector/scalar-engine time and its
HBM time (engines and DMA overlap within an op; ops run one after another). Collectives
take a fixed latency plus their bytes over the link they cross: the chip's own HBM when
all ranks share a chip, NeuronLink between chips of an instance, EFA between instances.
The factors (fractions of peak, a fusion share, two latencies) are fitted to published
benchmarks by calibrate.py; `fitted.py` holds the result and its held-out error band.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from neuronlocal.core import topology
from neuronlocal.estimate.counting import OpCost, Tally
from neuronlocal.estimate.rates import InstanceSpec


@dataclass(frozen=True)
class Factors:
    tensor: float  # fraction of tensor-engine peak matmuls reach
    hbm: float  # fraction of HBM bandwidth reached
    vector: float  # fraction of the vector + scalar engines' rate reached
    fusion: float  # share of elementwise bytes that reach HBM (the rest stays in SBUF)
    link: float  # fraction of NeuronLink / EFA bandwidth a collective reaches
    latency: float  # seconds of fixed cost per collective
    launch: float  # seconds of fixed cost per graph execution
    train: float = 1.0  # training compute / counted compute (recompute, grad accumulation)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def vector_(self) -> np.ndarray:
        return np.array([getattr(self, k) for k in NAMES])


# neuronx-cc casts FP32 matrix multiplications to BF16 unless told otherwise (its documented
# default, "--auto-cast matmult"): FP32 matmuls run at the BF16 rate, with FP32 bytes.
FP32_MATMUL_RATE = "bf16"
NAMES = ("tensor", "hbm", "vector", "fusion", "link", "latency", "launch", "train")


def link_bandwidth(spec: InstanceSpec, link: str, ranks_per_node: int | None = None) -> float:
    """Bytes/s one rank of a collective over `link` (core/topology.py's class) gets (peak,
    before the link factor); `ranks_per_node`: ranks sharing each instance's EFA (default:
    all its cores)."""
    if link in (topology.NONE, topology.SAME_CHIP):
        return spec.hbm_bytes_per_s  # ranks on one chip exchange through its HBM
    if link == topology.NEURONLINK and spec.link_bytes_per_s:
        return spec.link_bytes_per_s / spec.cores_per_chip
    if spec.net_bytes_per_s:
        return spec.net_bytes_per_s / (ranks_per_node or spec.cores)
    return spec.link_bytes_per_s / spec.cores_per_chip if spec.link_bytes_per_s else \
        spec.hbm_bytes_per_s


def collective_bandwidth(spec: InstanceSpec, group: int, ranks_per_node: int | None = None
                         ) -> float:
    """`link_bandwidth` of a `group`-rank collective whose ranks are consecutive (a layout
    known by its sizes alone)."""
    rpn = ranks_per_node or spec.cores
    return link_bandwidth(spec, topology.consecutive(group, spec.cores_per_chip, rpn), rpn)


def op_bandwidth(spec: InstanceSpec, op: OpCost, ranks_per_node: int | None = None) -> float:
    """Bandwidth of a counted collective: over the link its group's member ranks cross, as
    the counter recorded it, else as if its ranks were consecutive."""
    if op.link:
        return link_bandwidth(spec, op.link, ranks_per_node)
    return collective_bandwidth(spec, op.group, ranks_per_node)


class Compiled:
    """A tally's ops as arrays for one instance, so many factor sets evaluate quickly."""

    def __init__(self, tally: Tally, spec: InstanceSpec, ranks_per_node: int | None = None
                 ) -> None:
        rows = list(tally.ops.items())
        n = np.array([c for _, c in rows], dtype=float)
        is_t = np.array([op.engine == "tensor" for op, _ in rows], dtype=bool)
        is_v = np.array([op.engine == "vector" for op, _ in rows], dtype=bool)
        is_c = np.array([op.engine == "comm" for op, _ in rows], dtype=bool)
        peak = np.array([spec.tensor_flops(FP32_MATMUL_RATE if op.dtype == "fp32" else op.dtype)
                         for op, _ in rows], dtype=float)
        flops = np.array([op.flops for op, _ in rows], dtype=float)
        vec = np.array([op.vector for op, _ in rows], dtype=float)
        by = np.array([op.bytes for op, _ in rows], dtype=float)
        bw = np.array([op_bandwidth(spec, op, ranks_per_node)
                       if op.engine == "comm" else 1.0
                       for op, _ in rows], dtype=float)
        cb = np.array([op.comm_bytes for op, _ in rows], dtype=float)
        self.n_t, self.n_v, self.n_c = n * is_t, n * is_v, n * is_c
        self.is_t, self.is_v, self.is_c = is_t, is_v, is_c
        self.t_mm = np.where(is_t, flops / peak, 0.0)  # seconds at peak
        self.t_vec = np.where(is_t, vec, np.where(is_v, flops, 0.0)) / spec.vector_flops
        self.t_hbm = by / spec.hbm_bytes_per_s
        self.t_comm = np.where(is_c, cb / bw, 0.0)
        self.flops = float((flops * n * is_t).sum())

    def _rows(self, f: Factors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Seconds of one call of each row as a tensor, a vector and a collective op."""
        tensor = np.maximum(np.maximum(self.t_mm / f.tensor, self.t_vec / f.vector),
                            self.t_hbm / f.hbm)
        vector = np.maximum(self.t_vec / f.vector, self.t_hbm * f.fusion / f.hbm)
        comm = self.t_comm / f.link + f.latency
        return tensor, vector, comm

    def seconds(self, f: Factors) -> float:
        tensor, vector, comm = self._rows(f)
        return float((tensor * self.n_t).sum() + (vector * self.n_v).sum()
                     + (comm * self.n_c).sum())

    def per_call(self, f: Factors) -> np.ndarray:
        """Seconds of one call of each op of the tally, in its order: what `seconds` sums,
        before the counts (the overlap model prices a step's ops in issue order)."""
        tensor, vector, comm = self._rows(f)
        return np.where(self.is_t, tensor, np.where(self.is_v, vector,
                                                    np.where(self.is_c, comm, 0.0)))


def seconds(tally: Tally, spec: InstanceSpec, f: Factors, ranks_per_node: int | None = None
            ) -> float:
    """Seconds one core of `spec` spends on the ops of `tally`; `ranks_per_node`: ranks on
    each instance, for the link a collective crosses (default: all its cores)."""
    return Compiled(tally, spec, ranks_per_node).seconds(f)



# TorchNeuron's eager mode runs every ATen op as its own compiled kernel (a cached NEFF)
# launched through the Neuron runtime; Adaptive Eager Execution, which fuses queued ops, is
# opt-in. No published figure gives the cost of one such launch, so it is an assumption:
# at least EAGER_LAUNCH_MIN_S (one runtime execution; a GPU kernel launch costs a few
# microseconds) and at most the fitted cost of one graph execution (`Factors.launch`: an
# eager op is a graph of one op). The estimate uses the geometric middle of that range.
EAGER_LAUNCH_MIN_S = 10e-6


def eager_launch(f: Factors) -> tuple[float, float, float]:
    """(assumed, lowest, highest) seconds of one eager op's kernel launch."""
    low, high = EAGER_LAUNCH_MIN_S, max(f.launch, EAGER_LAUNCH_MIN_S)
    return math.sqrt(low * high), low, high


def eager_factors(f: Factors) -> Factors:
    """`f` for ops run one at a time: nothing fuses, so every elementwise byte reaches HBM."""
    return replace(f, fusion=1.0)


def launches(tally: Tally) -> float:
    """Kernel launches of a tally run eagerly: one per costed compute op (views and
    allocations are not kernels; collectives have their own latency)."""
    return float(sum(n for op, n in tally.ops.items() if op.engine != "comm"))
