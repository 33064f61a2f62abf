"""Runs the OpInfo and ModuleInfo sweeps (neuron vs CPU) and writes docs/op-support.md.

    .venv/bin/python tools/op_support.py                      # both full sweeps, then the docs
    .venv/bin/python tools/op_support.py --sweep modules      # one sweep (the other's JSON kept)
    .venv/bin/python tools/op_support.py --sweep none         # re-render the docs only
    .venv/bin/python tools/op_support.py --sweep opinfo --ci  # the fixed CI subset
    .venv/bin/python tools/op_support.py --sweep opinfo --only add,mm --out /tmp/x.md

Results go to docs/op-support.json (OpInfo) and docs/module-support.json (ModuleInfo); the
page adds where each op runs on Trainium, from the placement table (src/neuronlocal/eager/
op_placement.json, made by tools/op_placement.py). The sweep logic is
neuronlocal.support.opinfo_sweep and .module_sweep, shared with tests/test_opinfo.py and
tests/test_modules.py. Results are appended to `<json>.partial` as they come, so an
interrupted sweep can go on with --resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from neuronlocal.eager import ops as placement
from neuronlocal.support import module_sweep, opinfo_sweep

Result = opinfo_sweep.Result
STATUS_TEXT = {
    "pass": "pass",
    "fail": "**neuron-only failure**",
    "cpu-fail": "fails on CPU too",
    "skip": "skipped",
}
CELL = {"pass": "pass", "fail": "**FAIL**", "cpu-fail": "cpu-fail", "skip": "skip"}
SWEEPS = {"opinfo": (opinfo_sweep, "OpInfo", "op-support.json"),
          "modules": (module_sweep, "ModuleInfo", "module-support.json")}


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _load(path: Path) -> tuple[list[Result], dict[str, Any]] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rows = [Result(**{**r, "variants": tuple(r["variants"]), "ops": tuple(r.get("ops", ())),
                      "fallbacks": tuple(r.get("fallbacks", ()))}) for r in data["results"]]
    return rows, {k: v for k, v in data.items() if k != "results"}


def _rate(meta: dict[str, Any], what: str) -> str:
    s = meta["summary"]
    return (f"**{what}: {s['pass_rate']:.1%} of the ({'op' if what == 'OpInfo' else 'module'}"
            f", dtype) pairs that run on CPU pass on neuron** ({s['counts'].get('pass', 0)} of "
            f"{s['compared']}; {', '.join(meta['dtypes'])}; {meta['ops']} {what}s)")


# ---- placement ---------------------------------------------------------------------------


def _where(name: str) -> str:
    p = placement.placement(name)
    if p.placement != "composite":
        return p.placement
    return f"composite, {p.runs}" if "runs" in p.entry else "composite"


def _sweep_placements(sweeps: dict[str, list[Result]]) -> list[str]:
    """The ops the sweeps ran, counted by placement, and the host fallbacks they reached."""
    names = list(sweeps)
    lines = [
        "Distinct ATen ops that ran on neuron in the sweeps, by placement (composites that "
        "decompose before reaching the backend are seen as their pieces):",
        "",
        "| placement | " + " | ".join(f"{n} sweep" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    seen = {n: {op for r in rs for op in r.ops} for n, rs in sweeps.items()}
    kinds = ("device", "composite, device", "composite, host", "host")
    for kind in kinds:
        row = [str(sum(_where(op) == kind for op in seen[n] if _known(op))) for n in names]
        lines.append(f"| {kind} | " + " | ".join(row) + " |")
    lines.append("| total | " + " | ".join(str(len(seen[n])) for n in names) + " |")
    lines += ["", "Host fallbacks the sweeps reached, and from where:", "",
              "| op on the host | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    by_op: dict[str, dict[str, set[str]]] = {}
    for n, rs in sweeps.items():
        for r in rs:
            for op in r.fallbacks:
                by_op.setdefault(op, {}).setdefault(n, set()).add(r.op)
    for op in sorted(by_op):
        cells = [", ".join(sorted(by_op[op].get(n, ()))[:6])
                 + (" ..." if len(by_op[op].get(n, ())) > 6 else "") or "-" for n in names]
        lines.append(f"| `{op}` | " + " | ".join(_md(c) for c in cells) + " |")
    lines.append("")
    return lines


def placement_section(sweeps: dict[str, list[Result]]) -> list[str]:
    t = placement.table()
    every = placement.all_placements()
    counts = Counter(p.placement for p in every.values())
    direct = [p for p in every.values() if "runs" in p.entry]
    lines = [
        "## Where each op runs on Trainium",
        "",
        f"From TorchNeuron's public op coverage ({t['evidence']['source']}, extracted "
        f"{t['evidence']['extracted']}) and torch {t['torch']}'s own registrations, every ATen "
        "op gets one placement, with its evidence (`neuronlocal ops OP` prints it; the table "
        "is `src/neuronlocal/eager/op_placement.json`, generated by `tools/op_placement.py`, "
        "never edited by hand):",
        "",
        f"- **device** ({counts['device']} ops): TorchNeuron registers a device kernel.",
        f"- **composite** ({counts['composite']} ops): no device kernel, but torch has a "
        "composite kernel, so the op decomposes and its pieces are placed one by one "
        "(`div.Tensor` becomes `empty` + `div.out`, both on the device). neuronlocal runs "
        f"{len(direct)} of them as one CPU kernel (structured ops, composites with a CPU "
        "kernel, for CPU's numerics) and counts each where its pieces run: "
        f"{sum(p.runs == 'host' for p in direct)} have a piece without a device kernel and "
        "count as that piece's fallback (`atan2` as `atan2.out`).",
        f"- **host** ({counts['host']} ops): neither, so TorchNeuron's boxed CPU fallback runs "
        "it: its inputs are copied to the host and its results back, with a warning once per "
        "op (not for view and metadata ops).",
        "",
        "neuronlocal runs every op (CPU kernels on host memory) and uses this one table for "
        "op tracking (`torch_neuronx.get_fallback_ops()`, named by the op that falls back, as "
        "TorchNeuron names it), the once-per-op warning, `NEURONLOCAL_STRICT=1` (fallbacks "
        "become errors), `neuronlocal run`'s report and `neuronlocal check` (calls and bytes "
        "moved to and from the host per call), and the support matrix. "
        "`NEURONLOCAL_OP_PLACEMENT=native` counts every op as a device op, for numerics only.",
        "",
        "**64-bit rule.** On the device TorchNeuron computes float64 as float32 (its compiled "
        "path also int64 as int32) and casts results back; neuronlocal does the same "
        "(`NEURONLOCAL_DOWNCAST_64BIT`, int64 for arithmetic: pointwise ops, reductions, "
        "matmul). Host-fallback ops run on CPU as they are, so they compute in 64 bits. Ops "
        "that compute in float64 by definition ("
        + ", ".join(sorted({f"`{n.split('::')[1].split('.')[0].rstrip('_')}`"
                            for n in placement.float64_ops()}))
        + ", every overload) therefore give float32-precision results on Trainium; they warn "
        "once per op when the rule is on.",
        "",
        "**Caveats of the evidence.** It reads registrations and does not execute kernels: a "
        "registered op can still reach the host at run time when its kernel rejects an input "
        "(e.g. attention needs 4-D float inputs), and later releases add kernels. "
        "neuronlocal's attention follows CPU's kernel choice (for CPU's numerics) and counts "
        "CPU's flash attention as TorchNeuron's device attention kernel.",
        "",
    ]
    return lines + (_sweep_placements(sweeps) if sweeps else [])


def _known(op: str) -> bool:
    try:
        placement.placement(op)
    except KeyError:
        return False
    return True


def host_list() -> list[str]:
    lines = ["## Every op that runs on the host", "",
             "Host ops, and composites neuronlocal runs as one kernel whose pieces fall back "
             "(with the op that falls back). `neuronlocal ops OP` gives the evidence.", ""]
    for name, p in placement.all_placements().items():
        if p.runs != "host":
            continue
        extra = [f"runs `{p.host_op}`"] if p.host_op != name else []
        if p.quiet:
            extra.append("not warned")
        if p.entry.get("no_cpu_kernel"):
            extra.append("no CPU kernel either")
        lines.append(f"- `{name}`" + (f" ({'; '.join(extra)})" if extra else ""))
    return lines + [""]


# ---- sweep results -----------------------------------------------------------------------


def results_section(results: list[Result], meta: dict[str, Any], what: str,
                    known: dict[str, str]) -> list[str]:
    s = meta["summary"]
    dtypes = meta["dtypes"]
    by_name: dict[str, dict[str, Result]] = {}
    for r in results:
        by_name.setdefault(r.op, {})[r.dtype] = r
    lines = [f"## {what} sweep", "", "| status | pairs |", "|---|---|"]
    lines += [f"| {STATUS_TEXT[st]} | {s['counts'].get(st, 0)} |" for st in STATUS_TEXT]
    lines += [f"| total | {s['pairs']} |", "", f"### {what}: neuron-only failures", ""]
    fails = [r for r in results if r.status == "fail"]
    if fails:
        lines += ["| name | dtype | error |", "|---|---|---|"]
        for r in fails:
            reason = known.get(r.op, "")
            detail = f"{reason}. {r.detail[:200]}" if reason else r.detail
            lines.append(f"| `{r.op}` | {r.dtype} | {_md(detail)} |")
    else:
        lines.append("None.")
    for title, status in (("skipped", "skip"), ("fails on CPU too", "cpu-fail")):
        rows = [r for r in results if r.status == status]
        lines += ["", f"### {what}: {title}", ""]
        if not rows:
            lines.append("None.")
            continue
        lines += ["| name | dtype | reason |", "|---|---|---|"]
        lines += [f"| `{r.op}` | {r.dtype} | {_md(r.detail)} |" for r in rows]
    lines += ["", f"### {what}: all pairs", "",
              "`grad`: gradients compared; `ip`, `out`: in-place and `out=` variants compared; "
              "`train`, `eval`: module modes compared; `-`: not supported on CPU. Host: the ops "
              "of the pair that run on the host on Trainium.", "",
              "| name | " + " | ".join(dtypes) + " | host on Trainium |",
              "|---|" + "---|" * (len(dtypes) + 1)]
    short = {"in-place": "ip", "out=": "out", "train": "train", "eval": "eval"}
    for name in sorted(by_name):
        cells = []
        for d in dtypes:
            r = by_name[name].get(d)
            if r is None:
                cells.append("-")
                continue
            extra = (["grad"] if r.grad else []) + [short[v] for v in r.variants]
            cells.append(CELL[r.status] + (f" ({', '.join(extra)})" if extra else ""))
        host = sorted({op for r in by_name[name].values() for op in r.fallbacks})
        cells.append(", ".join(f"`{h.split('::')[1]}`" for h in host) or "-")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines + [""]


def render(loaded: dict[str, tuple[list[Result], dict[str, Any]]]) -> str:
    lines = ["# Op support on Trainium: placement and conformance", "",
             "<!-- generated by tools/op_support.py; do not edit by hand -->", ""]
    for key, (_, what, _) in SWEEPS.items():
        if key in loaded:
            lines += [_rate(loaded[key][1], what) + ".", ""]
    lines += [
        "Both sweeps generate PyTorch's own test inputs once on CPU and run them on CPU and on "
        "neuron: every sample of each OpInfo in `common_methods_invocations.op_db` (outputs, "
        "mutated inputs, gradients, in-place and `out=` variants) and every module input of "
        "each ModuleInfo in `common_modules.module_db` (forward in training and, where they "
        "differ, eval mode; buffers after the forward; gradients of parameters and inputs), "
        "compared with `torch.testing.assert_close`. A pair passes on CPU if at least one "
        "sample runs on CPU; the rate is pass / (pass + neuron-only failure). Random ops are "
        "compared by shapes and dtypes only (the neuron run draws from CPU's global generator "
        "after the CPU run). The 64-bit "
        "downcast is off for the sweeps, so int64 is compared exactly. Logic: "
        "`src/neuronlocal/support/opinfo_sweep.py`, `module_sweep.py`; tests: "
        "`tests/test_opinfo.py`, `tests/test_modules.py` (a CI subset by default, the full "
        "sweeps with `-m slow`).", ""]
    lines += placement_section({SWEEPS[k][1]: v[0] for k, v in loaded.items()})
    for key, (mod, what, _) in SWEEPS.items():
        if key in loaded:
            lines += results_section(*loaded[key], what, mod.KNOWN_FAILURES)
    return "\n".join(lines + host_list())


# ---- running -----------------------------------------------------------------------------


def run_sweep(mod: Any, cases: list[tuple[Any, str]], name_of: Any, js: Path, resume: bool,
              max_samples: int | None) -> tuple[list[Result], dict[str, Any]]:
    partial = js.with_name(js.name + ".partial")
    done: dict[str, Result] = {}
    if resume and partial.exists():
        for line in partial.read_text().splitlines():
            d = json.loads(line)
            r = Result(**{**d, "variants": tuple(d["variants"]), "ops": tuple(d["ops"]),
                          "fallbacks": tuple(d["fallbacks"])})
            done[r.id] = r
    else:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
    t0 = time.perf_counter()
    results: list[Result] = []
    with partial.open("a") as pf, tqdm(cases, unit="pair", file=sys.stderr) as bar:
        for case, dtype in bar:
            key = f"{name_of(case)}-{dtype}"
            bar.set_postfix_str(key[:40])
            if key in done:
                results.append(done[key])
                continue
            r = mod.run_case(case, dtype, max_samples)
            results.append(r)
            pf.write(json.dumps(dataclasses.asdict(r)) + "\n")
            pf.flush()
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "ops": len({r.op for r in results}), "dtypes": list(mod.DTYPES),
            "seconds": round(time.perf_counter() - t0, 1),
            "summary": opinfo_sweep.summarize(results)}
    rows = [json.dumps({k: v for k, v in dataclasses.asdict(r).items() if k != "seconds"})
            for r in results]
    head = json.dumps(meta, indent=1)[:-2]
    js.write_text(head + ',\n "results": [\n' + ",\n".join(rows) + "\n ]\n}\n")
    partial.unlink(missing_ok=True)
    return results, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", choices=["all", "opinfo", "modules", "none"], default="all")
    p.add_argument("--ops", type=int, default=None, help="only the first N OpInfos/ModuleInfos")
    p.add_argument("--only", default=None, help="comma-separated OpInfo/ModuleInfo names")
    p.add_argument("--ci", action="store_true", help="the fixed CI subsets")
    p.add_argument("--max-samples", type=int, default=None, help="samples per pair (all)")
    p.add_argument("--out", default="docs/op-support.md")
    p.add_argument("--resume", action="store_true", help="go on from <json>.partial")
    a = p.parse_args(argv)
    out = Path(a.out)
    todo = list(SWEEPS) if a.sweep == "all" else [] if a.sweep == "none" else [a.sweep]
    loaded: dict[str, tuple[list[Result], dict[str, Any]]] = {}
    for key, (mod, what, fname) in SWEEPS.items():
        js = out.with_name(fname)
        if key in todo:
            subset = opinfo_sweep.CI_OPS if key == "opinfo" else module_sweep.CI_MODULES
            names = tuple(a.only.split(",")) if a.only else subset if a.ci else None
            cases = mod.cases(names)
            name_of = opinfo_sweep.op_name if key == "opinfo" else (lambda m: m.name)
            if a.ops is not None:
                keep = set(list(dict.fromkeys(name_of(c) for c, _ in cases))[: a.ops])
                cases = [(c, d) for c, d in cases if name_of(c) in keep]
            loaded[key] = run_sweep(mod, cases, name_of, js, a.resume, a.max_samples)
            s = loaded[key][1]["summary"]
            print(f"{what}: {s['pass_rate']:.2%} pass on neuron ({s['counts'].get('pass', 0)}/"
                  f"{s['compared']}); {s['counts']} -> {js}")
        elif (prev := _load(js)) is not None:
            loaded[key] = prev
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(loaded))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
