"""`neuronlocal check`: would this model run on Trainium, and where does it fit?

Runs the support-matrix check on a tiny copy of the model's config (every mode, against
CPU) and estimates memory per core for the full-size config (parameters counted on the
meta device, nothing allocated), then prints a readable report. How the config and the
class are chosen: support/configs.py. Exit status: see EXIT_CODES.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from neuronlocal.core.units import fmt_bytes
from neuronlocal.support.configs import BadInput, Loaded, default_config_path, load

GiB = 2**30
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
# Exit status per outcome. Only 1 says something about neuron: 3 and 4 mean nothing could
# be compared, because the model failed before neuron ran.
EXIT_CODES = {"pass": 0, "neuron-fail": 1, "bad-input": 2, "build-fail": 3, "skipped": 3,
              "cpu-fail": 4}
EXIT_HELP = ("exit status: 0 runs on neuron in every mode that runs on CPU; 1 fails on neuron "
             "in a mode that runs on CPU; 2 bad input (config, model type, options); 3 the "
             "tiny model could not be built (nothing ran); 4 it does not run on CPU either "
             "(nothing to compare)")

__all__ = ["BadInput", "EXIT_CODES", "default_config_path", "memory_fit", "run"]


@dataclass
class Fit:
    params: int
    weight_bytes: int
    train_bytes: int
    infer_tp: dict[str, int | None]
    train_tp: dict[str, int | None]
    # instance -> FSDP degree where training fits only with FSDP over the cores TP leaves
    train_fsdp: dict[str, int] = dataclasses.field(default_factory=dict)
    degrees: tuple[int, ...] = TP_DEGREES  # the TP degrees the model's heads allow


def tp_degrees(cfg: Any) -> tuple[int, ...]:
    """TP_DEGREES the model's attention splits over (whole query heads per core, key/value
    heads split or replicated evenly); all of them when the config names no heads."""
    from neuronlocal.estimate.layout import tp_allowed

    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return TP_DEGREES
    kv = getattr(text, "num_key_value_heads", None) or heads
    return tuple(tp for tp in TP_DEGREES if tp_allowed(heads, kv, tp))


FIT_INSTANCES = ("trn2.3xlarge", "trn2.48xlarge")


def memory_fit(cfg: Any, model_cls: Any) -> Fit:
    """Bytes of the full-size model, and the smallest tensor-parallel degree that fits a core
    of each instance of FIT_INSTANCES (its logical cores and HBM per core under this
    process's LNC and NEURONLOCAL_HBM_PER_CORE)."""
    from neuronlocal.core import hardware, state

    with torch.device("meta"):
        model = model_cls(cfg)
    params = sum(p.numel() for p in model.parameters())
    weights = params * 2  # bf16 weights
    train = params * 16  # bf16 weights + grads, fp32 master copy + two AdamW states
    profiles = [hardware.profile(dataclasses.replace(state.config, instance=inst,
                                                     visible_cores=None))
                for inst in FIT_INSTANCES]

    degrees = tp_degrees(cfg)

    def smallest(total: int) -> dict[str, int | None]:
        # 10% of each core is left for activations and the KV cache.
        return {p.instance: next((tp for tp in degrees if tp <= p.total_cores
                                  and total / tp <= int(p.hbm_per_core * 0.9)), None)
                for p in profiles}

    train_tp = smallest(train)
    fsdp: dict[str, int] = {}
    for p in profiles:  # no TP degree alone: the largest allowed one, FSDP over the rest
        usable = [tp for tp in degrees if tp <= p.total_cores]
        if train_tp[p.instance] is None and usable and \
                train / p.total_cores <= int(p.hbm_per_core * 0.9):
            train_tp[p.instance] = usable[-1]
            fsdp[p.instance] = p.total_cores // usable[-1]
    return Fit(params, weights, train, smallest(weights), train_tp, fsdp, degrees)


def print_fallbacks(calls: dict[str, int], traffic: dict[str, dict[str, int]]) -> None:
    """Host-fallback ops with calls and the bytes each call copies to the host and back."""
    if not calls:
        print("CPU-fallback ops: none (every op has a Trainium device kernel)")
        return
    print("CPU-fallback ops (TorchNeuron runs them on the host; `neuronlocal ops OP` says why):")
    print(f"  {'op':<44}{'calls':>7}  {'to host / call':>15}  {'from host / call':>16}")
    for op, n in sorted(calls.items(), key=lambda kv: -kv[1]):
        t = traffic.get(op, {})
        print(f"  {op:<44}{n:>7}  {fmt_bytes(t.get('to_host', 0) / max(1, n), 1):>15}  "
              f"{fmt_bytes(t.get('from_host', 0) / max(1, n), 1):>16}")


def print_downcasts(calls: dict[str, int]) -> None:
    """Ops Trainium computes in 32 bits although their data is 64-bit, with their calls."""
    if not calls:
        print("64-bit downcasts: none")
        return
    print("64-bit downcasts (Trainium computes float64/int64 as 32-bit; these ops had 64-bit "
          "data):")
    print(f"  {'op':<44}{'calls':>7}")
    for op, n in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {op:<44}{n:>7}")


def _print_fit(loaded: Loaded, task: str) -> None:
    from neuronlocal.estimate import cli as estimate_cli

    try:
        fit = memory_fit(loaded.config, loaded.model_cls)
    except Exception as e:  # noqa: BLE001 - the estimate is advice, the check is the verdict
        print(f"\nmemory estimate unavailable: {type(e).__name__}: {e}")
        return
    print(f"\nfull size: {fit.params / 1e6:.1f}M parameters; bf16 weights "
          f"{fit.weight_bytes / GiB:.2f} GiB, training state ~{fit.train_bytes / GiB:.2f} GiB")
    for what, tp in (("inference", fit.infer_tp), ("training", fit.train_tp)):
        where = ", ".join(
            (f"{inst}: TP={d} x FSDP={fit.train_fsdp[inst]}" if what == "training"
             and inst in fit.train_fsdp else f"{inst}: TP={d}") if d
            else f"{inst}: does not fit" for inst, d in tp.items())
        print(f"  {what:<10} smallest tensor-parallel degree per instance -> {where}")
    if fit.degrees != TP_DEGREES:
        print(f"  (TP degrees this model's attention heads allow: "
              f"{', '.join(map(str, fit.degrees))})")
    if task != "causal-lm":  # the step model counts a causal LM's forward on its tokens
        print(f"  estimated training step: not estimated (step estimates cover causal-LM "
              f"models; a {task} step is not modelled)")
        return
    try:
        print(estimate_cli.check_line(loaded.config, fit.train_tp.get("trn2.48xlarge"),
                                      fsdp="trn2.48xlarge" in fit.train_fsdp))
    except Exception as e:  # noqa: BLE001 - the estimate is advice, the check is the verdict
        print(f"Trainium estimate unavailable: {type(e).__name__}: {e}")


def run(config: str | None, model_dir: str | None, model_type: str | None,
        trust_remote_code: bool = False, task: str = "causal-lm") -> int:
    from neuronlocal.estimate import capture as estimate_capture
    from neuronlocal.estimate import view as estimate_view
    from neuronlocal.support.models import TASK_MODES, check_model

    try:
        loaded = load(config, model_dir, model_type, trust_remote_code, task)
    except BadInput as e:
        print(f"error: {e}")
        return EXIT_CODES["bad-input"]
    mt = loaded.config.model_type
    for note in loaded.notes:
        print(f"warning: {note}")
    print(f"checking {mt} ({loaded.architecture}, {loaded.how}) on a tiny random copy of its "
          "config ...")
    with estimate_capture.capturing() as cap, warnings.catch_warnings():
        # The shapes mode varies the sequence length on purpose: the static-shapes advice is
        # about a program's own dynamic shapes, not the check's. CPU fallbacks are reported
        # below as a table, so their one-line warnings would say it twice.
        warnings.filterwarnings("ignore", message="neuron compiles static shapes")
        warnings.filterwarnings("ignore", message=r".* executed via CPU fallback")
        rep = check_model(mt, loaded.architecture, config=loaded.config, modes=TASK_MODES[task],
                          task=task, model_cls=loaded.model_cls)
    if rep.status in ("build-fail", "skipped"):
        print(f"\nthe tiny model could not be built, so nothing ran on CPU or neuron: "
              f"{rep.error}")
        print(f"\nverdict: {mt} UNTESTED: it fails before neuron runs (not a neuron result).")
        return EXIT_CODES[rep.status]
    print(f"\n{'mode':<10}{'cpu':<8}{'neuron':<8}{'max diff':<12}detail")
    for mode, m in rep.modes.items():
        diff = "-" if m.max_diff is None else f"{m.max_diff:.2e}"
        status = "ok" if m.neuron_ok else ("n/a" if not m.cpu_ok else "FAIL")
        detail = (m.error or "").splitlines()[0] if m.error else ""
        if m.graphs is not None and not detail:
            detail = f"{m.graphs} graphs compiled"
        print(f"{mode:<10}{'ok' if m.cpu_ok else 'fail':<8}{status:<8}{diff:<12}{detail}")
    print(f"\ncompiles: {rep.compiles} graphs; peak HBM (tiny copy): "
          f"{rep.peak_hbm / 2**20:.2f} MiB on neuron:0; wall time {rep.seconds:.1f}s")
    print_fallbacks(rep.fallback_ops, rep.fallback_traffic)
    print_downcasts(rep.downcast_ops)
    estimated = estimate_view.text(cap.snapshot())
    if estimated:
        print("\n" + estimated)
    _print_fit(loaded, task)
    advice = []
    if rep.fallback_ops:
        advice.append("avoid the CPU-fallback ops above in the hot path (they run on the host)")
    if rep.downcast_ops:
        advice.append("use 32-bit dtypes: Trainium computes 64-bit as 32-bit")
    if rep.status == "neuron-fail":
        advice.append(f"fix the failing mode: {rep.error}")
    verdict = {"pass": "RUNS on neuron in every mode that runs on CPU",
               "cpu-fail": "does not run on CPU either, so there is nothing to compare (not a "
                           "neuron result)",
               "neuron-fail": "does NOT run on neuron"}[rep.status]
    print(f"\nverdict: {mt} {verdict}.")
    for a in advice:
        print(f"  - {a}")
    return EXIT_CODES[rep.status]
