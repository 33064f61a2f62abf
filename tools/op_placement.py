"""Derives neuronlocal's op-placement table from TorchNeuron's public op-coverage data.

    .venv/bin/python tools/op_placement.py --reference path/to/torchneuron-ops.json

The reference lists the ATen ops that a public TorchNeuron snapshot registers device
kernels for (with the registration path and its dtype rules), its explicit CPU-fallback
list and its ambiguous registrations. This tool adds what torch itself says about each op
(composite kernels, the `.out` op a structured op delegates to, view schemas) and traces of
composite kernels run on the OpInfo and ModuleInfo samples (which ops a composite runs),
then writes src/neuronlocal/eager/op_placement.json: every ATen op of this torch with its
placement and the evidence for it. The file is never edited by hand: tests/test_placement.py
checks that `derive` makes exactly it out of the evidence it carries.

Placement, as TorchNeuron dispatches an op on Trainium:
- device: TorchNeuron registers a device kernel for it;
- composite: no device kernel, but torch has a composite kernel, so the op decomposes and
  its pieces are placed one by one;
- host: neither, so TorchNeuron's boxed CPU fallback runs it (warned once per op).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

OUT = Path(__file__).resolve().parents[1] / "src/neuronlocal/eager/op_placement.json"
KEYS = ("CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
        "CompositeExplicitAutogradNonFunctional", "Autograd")
CIA, CEA, CEANF = KEYS[1], KEYS[2], KEYS[3]
MAX_TRACES = 4  # composite runs traced per op

# Ops neuronlocal runs in place of a TorchNeuron device path that has another name: the
# attention kernel choice follows CPU's (so numerics match CPU), where TorchNeuron's
# `_fused_sdp_choice` stub selects its device attention kernel for 4-D float inputs.
STAND_INS: dict[str, str] = {
    "aten::_fused_sdp_choice": "TorchNeuron's _fused_sdp_choice stub (metadata, no data moved)",
    "aten::_scaled_dot_product_flash_attention_for_cpu":
        "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::_scaled_dot_product_fused_attention_overrideable_backward",
}
METADATA_PREFIXES = ("aten::is_", "aten::_is_", "aten::sym_", "aten::_nnz")


# ---- what torch says ---------------------------------------------------------------------


def registrations() -> dict[str, list[str]]:
    """Every ATen op of this torch with the KEYS it has a kernel for."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return {name: [k for k in KEYS if has(name, k)]
            for name in sorted(torch._C._dispatch_get_all_op_names())
            if name.startswith("aten::")}


def delegates() -> dict[str, str]:
    """Structured functional / in-place op -> the `.out` op its composite kernel calls."""
    import torchgen
    from torchgen.gen import parse_native_yaml

    base = Path(torchgen.__file__).parent / "packaged/ATen/native"
    parsed = parse_native_yaml(str(base / "native_functions.yaml"), str(base / "tags.yaml"))
    return {f"aten::{f.func.name}": f"aten::{f.structured_delegate}"
            for f in parsed.native_functions if f.structured_delegate is not None}


def schema_flags() -> dict[str, str]:
    """'view' (returns an alias, writes nothing) or 'metadata' per op; TorchNeuron's CPU
    fallback does not warn for these."""
    out = {}
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::"):
            continue
        name = f"{s.name}.{s.overload_name}" if s.overload_name else s.name
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments)
        if writes:
            continue
        if any(r.alias_info is not None for r in s.returns):
            out[name] = "view"
        elif name.startswith(METADATA_PREFIXES) and all("Tensor" not in str(r.type)
                                                         for r in s.returns):
            out[name] = "metadata"
    return out


# ---- which ops a composite runs ----------------------------------------------------------


class Trace:
    """Pieces of composite kernels, seen on CPU at the Python dispatch key."""

    def __init__(self, explicit: dict[str, Any], implicit: set[str]) -> None:
        self.explicit = explicit  # op -> the composite DispatchKey to run it with
        self.implicit = implicit
        self.pieces: dict[str, set[str]] = {}
        self.float_out: dict[str, bool] = {}
        self.f64: set[str] = set()
        self.runs: Counter[str] = Counter()
        self.stack: list[str] = []

    def note(self, name: str) -> None:
        if self.stack and self.stack[-1] != name:
            self.pieces[self.stack[-1]].add(name)

    def run(self, name: str, fn: Any, args: tuple, kwargs: dict) -> Any:
        """Runs a composite kernel with its pieces recorded; notes float64 by definition."""
        from torch.utils._pytree import tree_leaves

        self.runs[name] += 1
        self.pieces.setdefault(name, set())
        self.stack.append(name)
        try:
            with _Mode(self):
                out = fn(*args, **kwargs)
        finally:
            self.stack.pop()
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.float_out[name] = self.float_out.get(name, False) or any(
            t.is_floating_point() or t.is_complex() for t in outs)
        if (ins and outs and "dtype" not in kwargs
                and not any(t.dtype == torch.float64 for t in ins)
                and any(t.dtype == torch.float64 for t in outs)):
            self.f64.add(name)
        return out


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


class _Mode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        from torch.utils._pytree import tree_map

        kwargs = kwargs or {}
        t = self.trace
        name = func.name()
        t.note(name)
        key = t.explicit.get(name)
        if key is not None and t.runs[name] < MAX_TRACES and name not in t.stack:
            a2, k2 = tree_map(_clone, (args, kwargs))
            try:
                t.run(name, lambda *a, **k: func._op_dk(key, *a, **k), a2, k2)
            except Exception:  # noqa: BLE001,S110  (a composite that rejects this input)
                pass
        return func(*args, **kwargs)


def _hook_implicit(trace: Trace) -> None:
    """Routes CompositeImplicitAutograd ops through `trace` (under the Python dispatcher)."""
    dk = torch._C.DispatchKey.CompositeImplicitAutograd
    for name in trace.implicit:
        pkt, _, ov = name[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, pkt), ov or "default")
        except AttributeError:
            continue

        def kernel(*args: Any, _op: Any = op, _name: str = name, **kwargs: Any) -> Any:
            trace.note(_name)
            if trace.runs[_name] >= MAX_TRACES or _name in trace.stack:
                return _op._op_dk(dk, *args, **kwargs)
            return trace.run(_name, lambda *a, **k: _op._op_dk(dk, *a, **k), args, kwargs)

        op.py_kernels[dk] = kernel
        op._dispatch_cache.clear()


def _samples(max_samples: int) -> list[tuple[str, Any]]:
    """(label, thunk) for every OpInfo sample and every ModuleInfo forward+backward on CPU."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db
    from torch.utils._pytree import tree_leaves

    out: list[tuple[str, Any]] = []
    for op in op_db:
        dtypes = op.supported_dtypes("cpu")
        dtype = next((d for d in (torch.float32, torch.int64, torch.bool) if d in dtypes), None)
        if dtype is None:
            continue
        grad = op.supports_autograd and dtype.is_floating_point

        def run_op(op: Any = op, dtype: torch.dtype = dtype, grad: bool = grad) -> None:
            for s in list(op.sample_inputs("cpu", dtype, requires_grad=grad))[:max_samples]:
                try:
                    out = op(s.input, *s.args, **s.kwargs)
                    _backward(out)
                    if op.supports_out:  # reaches the `.out` overloads
                        outs = [torch.empty(0, dtype=t.dtype) for t in tree_leaves(out)]
                        with torch.no_grad():
                            op(s.input, *s.args, **s.kwargs,
                               out=outs[0] if isinstance(out, torch.Tensor) else tuple(outs))
                except Exception:  # noqa: BLE001,S112  (the trace keeps what ran)
                    continue
        out.append((op.name, run_op))
    for info in module_db:
        def run_module(info: Any = info) -> None:
            inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                             requires_grad=True, training=True)
            for mi in inputs[:max_samples]:
                if mi.forward_input is None:
                    continue
                try:
                    m = info.module_cls(*mi.constructor_input.args,
                                        **mi.constructor_input.kwargs)
                    _backward(m(*mi.forward_input.args, **mi.forward_input.kwargs))
                except Exception:  # noqa: BLE001,S112
                    continue
        out.append((info.name, run_module))
    return out


def _backward(out: Any) -> None:
    from torch.utils._pytree import tree_leaves

    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]
    if outs:
        torch.autograd.backward([o.sum() for o in outs], allow_unreachable=True)


def trace(regs: dict[str, list[str]], device_ops: set[str], max_samples: int) -> Trace:
    """Runs the samples with every composite kernel traced."""
    from torch._dispatch.python import enable_python_dispatcher

    key = {CEANF: torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional,
           CEA: torch._C.DispatchKey.CompositeExplicitAutograd}
    explicit = {n: key[CEANF if CEANF in k else CEA] for n, k in regs.items()
                if (CEANF in k or CEA in k) and n not in device_ops}
    implicit = {n for n, k in regs.items() if CIA in k}
    t = Trace(explicit, implicit)
    samples = _samples(max_samples)
    _hook_implicit(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, thunk in tqdm(samples, unit="op", file=sys.stderr, desc="tracing"):
            torch.manual_seed(0)
            try:
                with enable_python_dispatcher(), _Mode(t):
                    thunk()
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: {type(e).__name__}", file=sys.stderr)
    return t


# ---- the table ---------------------------------------------------------------------------


def direct_composites() -> set[str]:
    """Composites whose kernel computes on CPU only (it rejects other devices): neuronlocal
    registers the fallback for them directly; on Trainium the work is done on the host."""
    from neuronlocal.eager.ops import DEVICE_CHECKING_COMPOSITES

    return {f"aten::{n}" for n in DEVICE_CHECKING_COMPOSITES}


def _entry(name: str, keys: list[str], device: dict[str, Any], delegated: dict[str, str]
           ) -> dict[str, Any]:
    """One op's placement from its dispatch keys and the evidence, before its pieces."""
    if name in STAND_INS:
        return {"placement": "device", "stand_in": STAND_INS[name]}
    if name in device:
        return {"placement": "device"}
    if CIA in keys:
        return {"placement": "composite", "kind": "implicit"}
    if name in delegated:
        return {"placement": "composite", "kind": "structured", "pieces": [delegated[name]]}
    if CEANF in keys or CEA in keys:
        return {"placement": "composite", "kind": "explicit"}
    return {"placement": "host", **({} if "CPU" in keys else {"no_cpu_kernel": True})}


def _host_of(ops: dict[str, dict[str, Any]], name: str,
             seen: frozenset[str] = frozenset()) -> str | None:
    """The op that runs on the host when `name` runs, or None (all on the device)."""
    e = ops.get(name)
    if e is None or name in seen or e["placement"] == "device":
        return None
    if e["placement"] == "host":
        return name
    for p in e.get("pieces", ()):
        host = _host_of(ops, p, seen | {name})
        if host is not None:
            return host
    return None


def derive(evidence: dict[str, Any], regs: dict[str, list[str]], delegated: dict[str, str],
           flags: dict[str, str], traced: dict[str, Any], direct: set[str]
           ) -> dict[str, dict[str, Any]]:
    """Placement of every op in `regs` from the evidence (pure: the test re-runs it).
    `direct`: composites without a CPU kernel that neuronlocal still runs as one op."""
    pieces: dict[str, list[str]] = traced["pieces"]
    ops: dict[str, dict[str, Any]] = {}
    for name, keys in regs.items():
        e = _entry(name, keys, evidence["device_ops"], delegated)
        if e["placement"] == "composite" and "pieces" not in e and name in pieces:
            e["pieces"] = [p for p in pieces[name] if p in regs]
        if name in flags:
            e[flags[name]] = True
        if name in traced["f64"]:
            e["float64"] = True
        ops[name] = e
    for name, e in ops.items():
        keys = regs[name]
        run_directly = (e["placement"] == "composite" and e["kind"] != "implicit"
                        and ("CPU" in keys or name in direct))
        if run_directly and name in direct:  # its composite computes on CPU only
            e.update(runs="host", host_op=name, cpu_only=True)
        elif run_directly:  # neuronlocal runs it as one CPU kernel; Trainium runs its pieces
            host = _host_of(ops, name)
            e["runs"] = "host" if host else "device"
            if host:
                e["host_op"] = host
            if "pieces" not in e:
                e["untraced"] = True
        elif e["placement"] == "device" and CIA in keys and name in pieces:
            # TorchNeuron registers this composite: it never decomposes on Trainium. Where
            # its pieces would fall back, neuronlocal registers it directly too (when
            # autograd allows: torch has an Autograd kernel, or no output is a float).
            host = next((h for p in pieces[name] if (h := _host_of(ops, p)) is not None), None)
            if host and ("Autograd" in keys or not traced["float_out"].get(name, True)):
                e["direct"] = True
    return ops


def write(path: Path, evidence: dict[str, Any], traced: dict[str, Any],
          ops: dict[str, dict[str, Any]]) -> None:
    """One op per line, so a regeneration diffs readably."""
    counts = Counter(e["placement"] for e in ops.values())
    head = {
        "generated_by": "tools/op_placement.py (do not edit by hand)",
        "torch": torch.__version__.split("+")[0],
        "counts": dict(sorted(counts.items())),
    }
    lines = ["{"]
    for k, v in head.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v)},")
    lines.append(' "evidence": {')
    ev = list(evidence.items())
    for i, (k, v) in enumerate(ev):
        if isinstance(v, dict):
            lines.append(f"  {json.dumps(k)}: {{")
            items = sorted(v.items())
            for j, (op, info) in enumerate(items):
                comma = "," if j < len(items) - 1 else ""
                lines.append(f"   {json.dumps(op)}: {json.dumps(info, sort_keys=True)}{comma}")
            lines.append("  }" + ("," if i < len(ev) - 1 else ""))
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(ev) - 1 else ""))
    lines.append(" },")
    lines.append(f' "traced": {{"f64": {json.dumps(sorted(traced["f64"]))}, "float_out": '
                 f'{json.dumps(dict(sorted(traced["float_out"].items())))}, "pieces": {{')
    pcs = sorted(traced["pieces"].items())
    for j, (op, p) in enumerate(pcs):
        lines.append(f"  {json.dumps(op)}: {json.dumps(p)}" + ("," if j < len(pcs) - 1 else ""))
    lines.append(" }},")
    lines.append(' "ops": {')
    items = list(ops.items())
    for j, (op, e) in enumerate(items):
        lines.append(f"  {json.dumps(op)}: {json.dumps(e)}" + ("," if j < len(items) - 1 else ""))
    lines.append(" }")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True, help="torchneuron-ops.json")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--max-samples", type=int, default=8, help="samples per OpInfo/ModuleInfo")
    a = p.parse_args(argv)
    try:
        ref = json.loads(Path(a.reference).read_text())
        evidence = {k: ref[k] for k in ("source", "extracted", "notes", "device_ops",
                                        "cpu_fallback_explicit", "unclear")}
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--reference {a.reference}: not TorchNeuron's op-coverage JSON ({e})")
    regs = registrations()
    t = trace(regs, set(evidence["device_ops"]), a.max_samples)
    traced = {"pieces": {k: sorted(v) for k, v in t.pieces.items()},
              "float_out": t.float_out, "f64": sorted(t.f64)}
    ops = derive(evidence, regs, delegates(), schema_flags(), traced, direct_composites())
    write(Path(a.out), evidence, traced, ops)
    c = Counter(e["placement"] for e in ops.values())
    print(f"{len(ops)} ops: {dict(c)}; traced {len(t.pieces)} composites -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
