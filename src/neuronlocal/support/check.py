"""`neuronlocal check`: would this model run on Trainium, and where does it fit?

Runs the support-matrix check on a tiny copy of the model's config (every mode, against
CPU) and estimates memory per core for the full-size config (parameters counted on the
meta device, nothing allocated), then prints a readable report. Exit status: 0 runs on
neuron in every mode that runs on CPU, 1 does not, 2 bad input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

GiB = 2**30
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)


class BadInput(ValueError):
    """The config or model type cannot be used (exit status 2)."""


def default_config_path() -> Path:
    return Path(str(resources.files("neuronlocal.support") / "default_config.json"))


def load_config(config: str | None, model_dir: str | None, model_type: str | None) -> Any:
    from transformers import CONFIG_MAPPING, AutoConfig

    try:
        if model_dir:
            return AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if model_type:
            if model_type not in CONFIG_MAPPING:
                raise BadInput(f"unknown model type {model_type!r}; see "
                               "transformers.CONFIG_MAPPING for the known ones.")
            return CONFIG_MAPPING[model_type]()
        path = Path(config) if config else default_config_path()
        raw = json.loads(path.read_text())
        mt = raw.get("model_type")
        if mt not in CONFIG_MAPPING:
            raise BadInput(f"{path}: 'model_type' is {mt!r}, not a transformers model type.")
        return CONFIG_MAPPING[mt].from_dict(raw)
    except BadInput:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise BadInput(f"cannot read the model config: {type(e).__name__}: {e}") from e


def architecture_for(cfg: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    for arch in getattr(cfg, "architectures", None) or []:
        if arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
            return arch
    arch = CAUSAL.get(cfg.model_type)
    if arch is None:
        raise BadInput(f"model type {cfg.model_type!r} has no causal-LM class in transformers.")
    return arch[0] if isinstance(arch, (list, tuple)) else arch


@dataclass
class Fit:
    params: int
    weight_bytes: int
    train_bytes: int
    infer_tp: dict[str, int | None]
    train_tp: dict[str, int | None]


def memory_fit(cfg: Any, arch: str) -> Fit:
    """Bytes of the full-size model, and the smallest tensor-parallel degree that fits a core."""
    import transformers

    import neuronlocal

    with torch.device("meta"):
        model = getattr(transformers, arch)(cfg)
    params = sum(p.numel() for p in model.parameters())
    weights = params * 2  # bf16 weights
    train = params * 16  # bf16 weights + grads, fp32 master copy + two AdamW states
    hbm = neuronlocal.profile.hbm_per_core
    budget = int(hbm * 0.9)  # leave room for activations and the KV cache
    sizes = {"trn2.3xlarge": 4, "trn2.48xlarge": 64}

    def smallest(total: int) -> dict[str, int | None]:
        return {inst: next((tp for tp in TP_DEGREES if tp <= cores and total / tp <= budget),
                           None) for inst, cores in sizes.items()}

    return Fit(params, weights, train, smallest(weights), smallest(train))


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def print_fallbacks(calls: dict[str, int], traffic: dict[str, dict[str, int]]) -> None:
    """Host-fallback ops with calls and the bytes each call copies to the host and back."""
    if not calls:
        print("CPU-fallback ops: none (every op has a Trainium device kernel)")
        return
    print("CPU-fallback ops (TorchNeuron runs them on the host; `neuronlocal ops OP` says why):")
    print(f"  {'op':<44}{'calls':>7}  {'to host / call':>15}  {'from host / call':>16}")
    for op, n in sorted(calls.items(), key=lambda kv: -kv[1]):
        t = traffic.get(op, {})
        print(f"  {op:<44}{n:>7}  {_size(t.get('to_host', 0) / max(1, n)):>15}  "
              f"{_size(t.get('from_host', 0) / max(1, n)):>16}")


def run(config: str | None, model_dir: str | None, model_type: str | None) -> int:
    from neuronlocal.support.models import check_model

    try:
        cfg = load_config(config, model_dir, model_type)
        arch = architecture_for(cfg)
    except BadInput as e:
        print(f"error: {e}")
        return 2
    print(f"checking {cfg.model_type} ({arch}) on a tiny random copy of its config ...")
    from neuronlocal.estimate import capture as estimate_capture
    from neuronlocal.estimate import cli as estimate_cli
    from neuronlocal.estimate import view as estimate_view

    with estimate_capture.capturing() as cap:  # estimated Trainium time of graphs and steps
        rep = check_model(cfg.model_type, arch, config=cfg)
    print(f"\n{'mode':<10}{'cpu':<8}{'neuron':<8}{'max diff':<12}detail")
    for mode, m in rep.modes.items():
        diff = "-" if m.max_diff is None else f"{m.max_diff:.2e}"
        status = "ok" if m.neuron_ok else ("n/a" if not m.cpu_ok else "FAIL")
        print(f"{mode:<10}{'ok' if m.cpu_ok else 'fail':<8}{status:<8}{diff:<12}"
              f"{(m.error or '').splitlines()[0] if m.error else ''}")
    print(f"\ncompiles: {rep.compiles} graphs; peak HBM (tiny copy): "
          f"{rep.peak_hbm / 2**20:.2f} MiB on neuron:0; wall time {rep.seconds:.1f}s")
    print_fallbacks(rep.fallback_ops, rep.fallback_traffic)
    print(f"64-bit downcasts: {rep.downcast_ops or 'none'}")
    estimated = estimate_view.text(cap.snapshot())
    if estimated:
        print("\n" + estimated)
    try:
        fit = memory_fit(cfg, arch)
        print(f"\nfull size: {fit.params / 1e6:.1f}M parameters; bf16 weights "
              f"{fit.weight_bytes / GiB:.2f} GiB, training state ~{fit.train_bytes / GiB:.2f} GiB")
        for what, tp in (("inference", fit.infer_tp), ("training", fit.train_tp)):
            where = ", ".join(f"{inst}: TP={d}" if d else f"{inst}: does not fit"
                              for inst, d in tp.items())
            print(f"  {what:<10} smallest tensor-parallel degree per instance -> {where}")
        print(estimate_cli.check_line(cfg, fit.train_tp.get("trn2.48xlarge")))
    except Exception as e:  # noqa: BLE001 - the estimate is advice, the check is the verdict
        print(f"\nmemory estimate unavailable: {type(e).__name__}: {e}")
    advice = []
    if rep.fallback_ops:
        advice.append("avoid the CPU-fallback ops above in the hot path (they run on the host)")
    if rep.downcast_ops:
        advice.append("use 32-bit dtypes: Trainium computes 64-bit as 32-bit")
    if rep.status != "pass":
        advice.append(f"fix the failing mode: {rep.error}")
    verdict = {"pass": "RUNS on neuron in every mode that runs on CPU",
               "cpu-fail": "does not run on CPU either"}.get(rep.status, "does NOT run on neuron")
    print(f"\nverdict: {cfg.model_type} {verdict}.")
    for a in advice:
        print(f"  - {a}")
    return 0 if rep.status == "pass" else 1
