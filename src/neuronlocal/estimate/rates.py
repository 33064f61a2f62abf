"""Peak rates of the instances the estimator knows, and their on-demand prices (data, dated).

Chip peaks (tensor engine FLOPS, HBM bytes/s) come from `neuronlocal.core.hardware`; this module
adds what only the estimator needs: the vector and scalar engines' rate, the NeuronLink
bandwidth per chip, the EFA bandwidth per instance, FP8 peaks and prices. Every number is a
published figure; docs/estimate.md lists the page each one comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuronlocal.core.hardware import INFERENTIA2, TRAINIUM1, TRAINIUM2, TRAINIUM3, Chip, GiB

GB = 10**9

# Vector + scalar engine FP32 rate of one physical NeuronCore (v2: 2.3 + 2.9 TFLOPS,
# v3: 1.0 + 1.2, v4: 1.2 + 1.2), the rate elementwise and reduction work runs at.
_VECTOR = {TRAINIUM1.name: 5.2e12, INFERENTIA2.name: 5.2e12, TRAINIUM2.name: 2.2e12,
           TRAINIUM3.name: 2.4e12}
# Dense FP8 chip peaks (Trn1/Inf2: cFP8 at the BF16 rate; Trn2 1,299; Trn3 MXFP8 2,517).
_FP8 = {TRAINIUM1.name: 190e12, INFERENTIA2.name: 190e12, TRAINIUM2.name: 1299e12,
        TRAINIUM3.name: 2517e12}


@dataclass(frozen=True)
class InstanceSpec:
    """One instance type as the roofline sees it, per logical NeuronCore at a given LNC."""

    name: str
    chip: Chip
    chips: int
    link_bytes_per_s: float  # NeuronLink bandwidth of one chip (0: single chip)
    net_bytes_per_s: float  # EFA bandwidth of the instance (0: unknown / not offered)
    lnc: int = 1

    @property
    def cores_per_chip(self) -> int:
        return self.chip.physical_cores // self.lnc

    @property
    def cores(self) -> int:
        return self.cores_per_chip * self.chips

    def tensor_flops(self, dtype: str) -> float:
        """Tensor-engine peak of one logical core for 'bf16', 'fp32' or 'fp8' operands."""
        chip = {"bf16": self.chip.bf16_flops, "fp32": self.chip.fp32_flops,
                "fp8": _FP8[self.chip.name]}[dtype]
        return chip / self.cores_per_chip

    @property
    def vector_flops(self) -> float:
        return _VECTOR[self.chip.name] * self.lnc

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.chip.hbm_bytes_per_s / self.cores_per_chip

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes // self.cores_per_chip

    def with_lnc(self, lnc: int) -> InstanceSpec:
        return InstanceSpec(self.name, self.chip, self.chips, self.link_bytes_per_s,
                            self.net_bytes_per_s, lnc)


INSTANCES: dict[str, InstanceSpec] = {s.name: s for s in (
    InstanceSpec("trn1.2xlarge", TRAINIUM1, 1, 0, 0),
    InstanceSpec("trn1.32xlarge", TRAINIUM1, 16, 384 * GiB, 800e9 / 8),
    InstanceSpec("trn1n.32xlarge", TRAINIUM1, 16, 768 * GiB, 1600e9 / 8),
    InstanceSpec("inf2.xlarge", INFERENTIA2, 1, 0, 0),
    InstanceSpec("inf2.8xlarge", INFERENTIA2, 1, 0, 0),
    InstanceSpec("inf2.24xlarge", INFERENTIA2, 6, 192 * GiB, 0),
    InstanceSpec("inf2.48xlarge", INFERENTIA2, 12, 192 * GiB, 0),
    InstanceSpec("trn2.3xlarge", TRAINIUM2, 1, 0, 0, 2),
    InstanceSpec("trn2.48xlarge", TRAINIUM2, 16, 1024 * GB, 3200e9 / 8, 2),
    InstanceSpec("trn3.3xlarge", TRAINIUM3, 1, 0, 0, 2),
    InstanceSpec("trn3.48xlarge", TRAINIUM3, 16, 2048 * GiB, 3200e9 / 8, 2),
)}


def instance(name: str, lnc: int | None = None) -> InstanceSpec:
    """The spec of `name` at `lnc` (None: the instance default). KeyError names the choices."""
    if name not in INSTANCES:
        raise KeyError(f"unknown instance {name!r}; known: {', '.join(INSTANCES)}")
    spec = INSTANCES[name]
    if lnc and lnc != spec.lnc and spec.lnc == 1:
        raise KeyError(f"{name} has one logical core size (LNC=1); LNC={lnc} applies to "
                       "Trn2 and Trn3 instances only")
    return spec.with_lnc(lnc) if lnc else spec


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str
    verified: bool  # False: a third-party figure, not confirmed on an AWS or Neuron page


PRICES_DATE = "2026-10-20"  # when this table was last checked
PRICES_REGION = "us-east-1 (N. Virginia), Linux, on-demand"
_NEURON_TRN1 = ("https://github.com/aws-neuron/aws-neuron-sdk/blob/"
                "c6ec6484ee79cb9e0f4ab5a14c18eabc0b6e3b95/general/benchmarks/trn1/"
                "trn1_instance_prices.csv")
_NEURON_INF2 = ("https://github.com/aws-neuron/aws-neuron-sdk/blob/"
                "277baef4e8981b689a571ee44e2dd7e733612a45/general/benchmarks/inf2/"
                "inf2_instance_prices.csv")
_THIRD_PARTY = "third-party cost tables (see docs/estimate.md); not on an AWS page we could read"
PRICES: dict[str, Price] = {
    "trn1.2xlarge": Price(1.34, _NEURON_TRN1, True),
    "trn1.32xlarge": Price(21.50, _NEURON_TRN1, True),
    "inf2.xlarge": Price(0.758, _NEURON_INF2, True),
    "inf2.8xlarge": Price(1.97, _NEURON_INF2, True),
    "inf2.24xlarge": Price(6.49, _NEURON_INF2, True),
    "inf2.48xlarge": Price(12.981, _NEURON_INF2, True),
    "trn2.3xlarge": Price(2.23, _THIRD_PARTY, False),
    "trn2.48xlarge": Price(35.76, _THIRD_PARTY, False),
}


def price(name: str, override: float | None = None) -> Price | None:
    """The hourly price of `name` (a user override wins); None when no price is known."""
    if override is not None:
        return Price(override, "--price-per-hour", True)
    return PRICES.get(name)
