"""Published Neuron benchmark rows the estimator is calibrated and tested against.

Every row is copied from an AWS Neuron documentation table (the GitHub source of the docs
at a fixed commit, so the number can be checked) and keeps its source URL. Split rule,
fixed before any fitting: within each metric, in the order listed here, every third point
(positions 3, 6, 9, ...) is held out; the others are fitted. docs/estimate.md prints both
sets and the held-out errors.

Excluded (listed, estimated and shown, but neither fitted nor held out): the time to first
token of transformers-neuronx. Those rows contradict the hardware and every other stack:
on the same model and prompt, inf2.48xlarge (24 cores, half the link bandwidth) beats
trn1.32xlarge (32 cores) by 2.4x, and trn1 runs the 8k prompts at about 4% of peak.
"""

from __future__ import annotations

from dataclasses import dataclass

_GH = "https://github.com/aws-neuron/aws-neuron-sdk/blob/"
_DEC2024 = "752349fd3de5aaa6eb69690955eeaa7d43fcd082/general/benchmarks/trn1/"
TRN1_TRAIN_DECODER = _GH + _DEC2024 + "training_data_decoder.csv"
TRN1_TRAIN_ENCODER = _GH + _DEC2024 + "training_data_encoder.csv"
TRN1_TRAIN_VISION = _GH + _DEC2024 + "training_data_vision_transformers.csv"
TRN1_TRAIN_GPT3 = (_GH + "8907253c199749a9618a759b76ba52b64e8efb68/general/benchmarks/trn1/"
                   "training_data_decoder.csv")
_HEAD = _GH + "81ce03ae261e12925e53437a0f690478e6366155/"
INF2_LATENCY = _HEAD + "about-neuron/benchmarks/inf2/latency_data_decoder.csv"
INF2_THROUGHPUT = _HEAD + "about-neuron/benchmarks/inf2/throughput_data_decoder.csv"
INF2_ENCODER = _HEAD + "about-neuron/benchmarks/inf2/throughput_data_encoder.csv"
TRN1_LATENCY = _HEAD + "about-neuron/benchmarks/trn1/latency_data_decoder.csv"
TRN1_THROUGHPUT = _HEAD + "about-neuron/benchmarks/trn1/throughput_data_decoder.csv"
TRN1_ENCODER = _HEAD + "about-neuron/benchmarks/trn1/throughput_data_encoder.csv"
TRN2_70B = (_HEAD + "libraries/nxd-inference/tutorials/llama70b_perf_comparison.csv "
            "(setup: libraries/nxd-inference/tutorials/trn2-llama3.3-70b-tutorial.rst)")
TRN2_405B = (_HEAD + "libraries/nxd-inference/tutorials/llama405b_perf_comparison.csv (setup: "
             "libraries/nxd-inference/tutorials/trn2-llama3.1-405b-speculative-tutorial.rst)")
TRN2_8B = (_HEAD + "vllm-neuron/docs/tutorials/"
           "tutorial-eagle3-speculative-decoding-llama-3-1.md (baseline column)")


@dataclass(frozen=True)
class Row:
    """One published measurement and the setup it was measured with."""

    id: str
    model: str  # a preset of presets.PRESETS
    instance: str
    mode: str  # train | prefill | decode | forward
    metric: str  # seq_per_s | ttft_ms | tpot_ms | items_per_s
    value: float
    source: str
    sdk: str
    nodes: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    seq: int = 0
    ctx: int = 0
    arch: str = "causal-lm"
    dtype: str = "bf16"
    note: str = ""
    excluded: str = ""  # why the row is neither fitted nor held out (empty: used)


TNX_TTFT = ("transformers-neuronx prompt encoding: inconsistent with the hardware and with "
            "every other stack (see the module docstring)")


def _train(id: str, model: str, value: float, nodes: int, tp: int, pp: int, dp: int, mb: int,
           gbs: int, seq: int, source: str, sdk: str, arch: str = "causal-lm",
           dtype: str = "bf16", note: str = "") -> Row:
    return Row(id, model, "trn1.32xlarge", "train", "seq_per_s", value, source, sdk, nodes, tp,
               pp, dp, mb, gbs, seq, 0, arch, dtype, note)


def _latency(id: str, model: str, instance: str, tp: int, ttft: float | None, tpot: float,
             prompt: int, out: int, source: str, sdk: str, batch: int = 1,
             bucket: int | None = None) -> list[Row]:
    """A TTFT point (prefill of the prompt, or its bucket) and a TPOT point (one decode step
    at the mean context, prompt + out/2)."""
    rows = []
    if ttft is not None:
        rows.append(Row(id + "/ttft", model, instance, "prefill", "ttft_ms", ttft, source, sdk,
                        tp=tp, micro_batch=1, seq=bucket or prompt,
                        excluded="" if instance.startswith("trn2") else TNX_TTFT))
    rows.append(Row(id + "/tpot", model, instance, "decode", "tpot_ms", tpot, source, sdk,
                    tp=tp, micro_batch=batch, seq=1, ctx=prompt + out // 2))
    return rows


def _encoder(id: str, model: str, instance: str, batch: int, value: float, source: str,
             sdk: str) -> Row:
    return Row(id, model, instance, "forward", "items_per_s", value, source, sdk,
               micro_batch=batch, seq=128, arch="encoder")


_NXD = "NxD Training, Autocast BF16 + FP32 optimizer, AdamW"
_BERT = "HF BERT pretraining tutorial, data parallel"
ROWS: tuple[Row, ...] = (
    _train("trn1/llama-2-7b", "llama-2-7b", 95.14, 16, 8, 1, 64, 1, 1024, 4096,
           TRN1_TRAIN_DECODER, "2.21.0", note=_NXD),
    _train("trn1/llama-2-13b", "llama-2-13b", 80.33, 32, 8, 8, 16, 1, 1024, 4096,
           TRN1_TRAIN_DECODER, "2.21.0", note=_NXD),
    _train("trn1/llama-2-70b", "llama-2-70b", 14.44, 32, 32, 8, 4, 1, 1024, 4096,
           TRN1_TRAIN_DECODER, "2.21.0", note=_NXD),
    _train("trn1/llama-3.1-8b", "llama-3.1-8b", 53.51, 32, 32, 1, 32, 1, 1024, 8192,
           TRN1_TRAIN_DECODER, "2.21.0", note=_NXD + ", ZeRO-1"),
    _train("trn1/llama-3.1-70b", "llama-3.1-70b", 7.97, 32, 32, 8, 4, 1, 1024, 8192,
           TRN1_TRAIN_DECODER, "2.21.0", note=_NXD),
    _train("trn1/gpt3-175b", "gpt3-175b", 14.60, 32, 32, 8, 4, 1, 1024, 2048,
           TRN1_TRAIN_GPT3, "2.18.0", note="NeMo Megatron, Autocast BF16 + SR, AdamW"),
    _train("trn1/bert-large-ph1-16n", "bert-large", 55102.1, 16, 1, 1, 512, 16, 1048576, 128,
           TRN1_TRAIN_ENCODER, "2.21.0", "bert-pretraining", note=_BERT + ", BF16, LAMB"),
    _train("trn1/bert-large-ph1-16n-adamw", "bert-large", 26069.4, 16, 1, 1, 512, 16, 16384,
           128, TRN1_TRAIN_ENCODER, "2.21.0", "bert-pretraining",
           note=_BERT + ", BF16/AMP, AdamW (strong scaling)"),
    _train("trn1/bert-large-ph1-16n-fp32", "bert-large", 35144.6, 16, 1, 1, 512, 8, 1048576,
           128, TRN1_TRAIN_ENCODER, "2.21.0", "bert-pretraining", "fp32",
           note=_BERT + ", FP32, LAMB"),
    _train("trn1/bert-large-ph1-1n", "bert-large", 3963.0, 1, 1, 1, 32, 16, 16384, 128,
           TRN1_TRAIN_ENCODER, "2.21.0", "bert-pretraining", note=_BERT + ", BF16, AdamW"),
    _train("trn1/bert-large-ph1-1n-lamb", "bert-large", 4137.9, 1, 1, 1, 32, 16, 65536, 128,
           TRN1_TRAIN_ENCODER, "2.21.0", "bert-pretraining", note=_BERT + ", BF16, LAMB"),
    _train("trn1/vit-base", "vit-base", 5907.61, 1, 1, 1, 32, 64, 2048, 197,
           TRN1_TRAIN_VISION, "2.21.0", "image-classification",
           note="HF ViT-Base fine-tuning, BF16, AdamW"),
    # Transformers NeuronX, batch 1 ("Real Time"), BF16 weights.
    *_latency("inf2/llama-2-7b", "llama-2-7b", "inf2.48xlarge", 24, 27.64, 6.47, 128, 3968,
              INF2_LATENCY, "2.18.0"),
    *_latency("inf2/llama-2-13b", "llama-2-13b", "inf2.48xlarge", 24, 25.85, 9.17, 128, 3968,
              INF2_LATENCY, "2.18.0"),
    *_latency("inf2/llama-2-13b-8k", "llama-2-13b", "inf2.48xlarge", 24, 994.18, 13.50, 8192,
              8192, INF2_LATENCY, "2.18.0"),
    *_latency("inf2/llama-2-70b", "llama-2-70b", "inf2.48xlarge", 24, 76.60, 32.90, 128, 128,
              INF2_LATENCY, "2.18.0"),
    *_latency("inf2/llama-2-70b-2k", "llama-2-70b", "inf2.48xlarge", 24, 810.44, 34.90, 2048,
              2048, INF2_LATENCY, "2.18.0"),
    *_latency("inf2/llama-3-70b-1k", "llama-3.1-70b", "inf2.48xlarge", 24, 310.18, 33.14,
              1024, 1024, INF2_LATENCY, "2.18.1"),
    *_latency("inf2/mistral-7b", "mistral-7b", "inf2.48xlarge", 24, 27.34, 6.86, 128, 3968,
              INF2_LATENCY, "2.18.0"),
    *_latency("inf2/mistral-7b-8k", "mistral-7b", "inf2.48xlarge", 24, 539.59, 10.33, 8192,
              8192, INF2_LATENCY, "2.18.0"),
    *_latency("inf2/codellama-13b-4k", "codellama-13b", "inf2.48xlarge", 24, 338.67, 10.15,
              4096, 4096, INF2_LATENCY, "2.18.0"),
    *_latency("trn1/llama-2-7b", "llama-2-7b", "trn1.32xlarge", 32, 13.32, 6.70, 128, 8064,
              TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/llama-2-13b-4k", "llama-2-13b", "trn1.32xlarge", 32, 864.14, 9.84, 4096,
              4096, TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/llama-2-13b-8k", "llama-2-13b", "trn1.32xlarge", 32, 2367.93, 13.41, 8192,
              8192, TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/llama-2-70b", "llama-2-70b", "trn1.32xlarge", 32, 53.91, 25.18, 128, 128,
              TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/llama-2-70b-2k", "llama-2-70b", "trn1.32xlarge", 32, 690.96, 26.85, 2048,
              2048, TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/llama-3-70b-2k", "llama-3.1-70b", "trn1.32xlarge", 32, 547.0, 26.2, 2048,
              2048, TRN1_LATENCY, "2.18.1"),
    *_latency("trn1/codellama-13b-8k", "codellama-13b", "trn1.32xlarge", 32, 2372.93, 13.40,
              8192, 8192, TRN1_LATENCY, "2.18.0"),
    *_latency("trn1/mistral-7b-8k", "mistral-7b", "trn1.32xlarge", 32, 1322.87, 9.89, 8192,
              8192, TRN1_LATENCY, "2.18.0"),
    # NxD Inference on Trn2 (LNC=2), batch 1, prompt 10,000 tokens, 1,500 out; prefill
    # buckets from the tutorials' context-encoding bucket lists.
    *_latency("trn2/llama-3.3-70b", "llama-3.3-70b", "trn2.48xlarge", 64, 814.2, 19.6, 10000,
              1500, TRN2_70B, "2.22+", bucket=12288),
    *_latency("trn2/llama-3.1-405b", "llama-3.1-405b", "trn2.48xlarge", 64, 2442.0, 37.9,
              10000, 1500, TRN2_405B, "2.22+", bucket=10240),
    # vLLM Neuron on Trn2, TP=8 (8 of 64 cores), 2 concurrent requests, 512 in / 128 out.
    *_latency("trn2/llama-3.1-8b", "llama-3.1-8b", "trn2.48xlarge", 8, 51.07, 10.52, 512, 128,
              TRN2_8B, "2.29+", batch=2),
    # Transformers NeuronX, batched decoding ("Batch"), BF16 weights: TPOT only (their TTFT
    # includes queueing of the batch).
    *_latency("inf2/llama-2-7b-b8", "llama-2-7b", "inf2.48xlarge", 24, None, 12.11, 128, 3968,
              INF2_THROUGHPUT, "2.18.0", batch=8),
    *_latency("inf2/llama-2-13b-b8", "llama-2-13b", "inf2.48xlarge", 24, None, 14.90, 128,
              3968, INF2_THROUGHPUT, "2.18.0", batch=8),
    *_latency("inf2/mistral-7b-b8", "mistral-7b", "inf2.48xlarge", 24, None, 11.64, 128, 3968,
              INF2_THROUGHPUT, "2.18.0", batch=8),
    *_latency("trn1/llama-2-70b-b4", "llama-2-70b", "trn1.32xlarge", 32, None, 27.21, 128,
              1024, TRN1_THROUGHPUT, "2.18.0", batch=4),
    *_latency("trn1/llama-2-13b-b8", "llama-2-13b", "trn1.32xlarge", 32, None, 19.86, 4096,
              4096, TRN1_THROUGHPUT, "2.18.0", batch=8),
    *_latency("trn1/llama-2-7b-b8", "llama-2-7b", "trn1.32xlarge", 32, None, 10.10, 128, 8064,
              TRN1_THROUGHPUT, "2.18.0", batch=8),
    # torch-neuronx encoders, one model copy per core (data parallel), sequence 128.
    _encoder("inf2/bert-base", "bert-base", "inf2.xlarge", 8, 2674.19, INF2_ENCODER, "2.27.0"),
    _encoder("inf2/bert-large", "bert-large", "inf2.xlarge", 4, 950.05, INF2_ENCODER, "2.21.0"),
    _encoder("inf2/distilbert-base", "distilbert-base", "inf2.xlarge", 16, 5307.88,
             INF2_ENCODER, "2.27.0"),
    _encoder("inf2/roberta-base", "roberta-base", "inf2.xlarge", 8, 2920.38, INF2_ENCODER,
             "2.25.0"),
    _encoder("inf2/roberta-large", "roberta-large", "inf2.xlarge", 4, 962.70, INF2_ENCODER,
             "2.25.0"),
    _encoder("trn1/bert-base", "bert-base", "trn1.2xlarge", 16, 3421.57, TRN1_ENCODER,
             "2.27.0"),
    _encoder("trn1/bert-large", "bert-large", "trn1.2xlarge", 4, 1104.44, TRN1_ENCODER,
             "2.27.0"),
    _encoder("trn1/distilbert-base", "distilbert-base", "trn1.2xlarge", 16, 6369.44,
             TRN1_ENCODER, "2.28.0"),
    _encoder("trn1/roberta-base", "roberta-base", "trn1.2xlarge", 16, 3378.11, TRN1_ENCODER,
             "2.28.0"),
    _encoder("trn1/roberta-large", "roberta-large", "trn1.2xlarge", 8, 1123.90, TRN1_ENCODER,
             "2.27.0"),
)


def held_out(rows: tuple[Row, ...] = ROWS) -> set[str]:
    """Ids of the held-out points: every third point of each metric, in listed order."""
    seen: dict[str, int] = {}
    out = set()
    for r in rows:
        if r.excluded:
            continue
        seen[r.metric] = seen.get(r.metric, 0) + 1
        if seen[r.metric] % 3 == 0:
            out.add(r.id)
    return out
