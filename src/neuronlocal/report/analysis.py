"""Why each graph was compiled again, and which bucket set would stop it.

Two mechanisms recompile on neuron: Dynamo itself (a guard fails, e.g. `tensor 'x' size
mismatch at index 1. expected 5, actual 7`, and it traces the frame again, usually into a
symbolic graph), and the neuron backend, which compiles a symbolic graph once per
concrete shape (kind="specialized"), as Trainium compiles static shapes only. Graphs are
grouped by the Dynamo frame they came from; each graph after the first of its frame is a
recompilation, and its reason is Dynamo's failed guard where Dynamo recompiled, else the
input dimension that changed. Dimensions seen with several sizes get a bucket suggestion.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from neuronlocal.compile.bucketing import suggest_buckets

_CID = re.compile(r"(\d+)/(\d+)")
_TENSOR = re.compile(r"tensor '([^']+)' size mismatch at index (\d+)")


def _frame(graph: dict[str, Any]) -> tuple[str, int | None, int | None]:
    cid = str(graph.get("extra", {}).get("compile_id", ""))
    m = _CID.search(cid)
    if m:
        return f"frame {m.group(1)}", int(m.group(1)), int(m.group(2))
    base = graph["graph_name"].rsplit("_", 1)[0]
    return f"{base}/{len(graph['input_shapes'])} inputs", None, None


def _function(frame: int | None, compile_ids: dict[str, Any]) -> str:
    for cid, m in compile_ids.items():
        hit = _CID.search(cid)
        if hit and frame is not None and int(hit.group(1)) == frame:
            return f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})"
    return "?"


def _changes(before: list[Any], after: list[Any]) -> list[dict[str, int]]:
    out = []
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        a, b = tuple(a), tuple(b)
        if len(a) != len(b):
            out.append({"input": i, "dim": -1, "before": len(a), "after": len(b)})
            continue
        out += [{"input": i, "dim": d, "before": x, "after": y}
                for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return out


def _guard(graph: dict[str, Any], compile_ids: dict[str, Any], seen: set[str]) -> str | None:
    """Dynamo's recompile reason, on the first graph of a frame's second+ compile only."""
    cid = str(graph.get("extra", {}).get("compile_id", ""))
    m = _CID.search(cid)
    if not m or int(m.group(2)) == 0 or cid in seen:
        return None
    seen.add(cid)
    metric = compile_ids.get(m.group(0))
    return getattr(metric, "recompile_reason", None) if metric is not None else None


def recompiles(graphs: list[dict[str, Any]], dynamo_recompiles: list[dict[str, Any]],
               compile_ids: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """{"recompiles": one entry per recompiled graph, "buckets": suggestions per dimension}."""
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    frames: dict[str, int | None] = {}
    for g in sorted(graphs, key=lambda g: g["graph_id"]):
        key, frame, _ = _frame(g)
        families[key].append(g)
        frames[key] = frame
    out: list[dict[str, Any]] = []
    buckets: list[dict[str, Any]] = []
    seen_cids: set[str] = set()
    for key, fam in families.items():
        function = _function(frames[key], compile_ids)
        names: dict[tuple[int, int], str] = {}
        _guard(fam[0], compile_ids, seen_cids)
        for prev_i, g in enumerate(fam[1:]):
            prev = fam[prev_i]
            guard = _guard(g, compile_ids, seen_cids)
            changed = _changes(prev["input_shapes"], g["input_shapes"])
            same_as = next((e["graph_name"] for e in fam[:prev_i + 1]
                            if e["input_shapes"] == g["input_shapes"]), None)
            if guard:
                for tname, idx in _TENSOR.findall(guard):
                    for c in changed:
                        if c["dim"] == int(idx):
                            names.setdefault((c["input"], c["dim"]), tname)
            if same_as:
                reason = (f"same shapes as {same_as}: Dynamo's automatic dynamic shapes made a "
                          "symbolic graph, which the neuron backend compiles again per shape")
            elif changed:
                reason = "; ".join(
                    f"input {c['input']} dim {c['dim']}: {c['before']} -> {c['after']}"
                    for c in changed)
                reason = f"new shape ({reason})"
            elif prev["input_dtypes"] != g["input_dtypes"]:
                reason = f"dtypes changed: {prev['input_dtypes']} -> {g['input_dtypes']}"
            else:
                reason = "same shapes and dtypes: grad mode, graph code or guards changed"
            out.append({"graph": g["graph_name"], "function": function, "frame": key,
                        "kind": g["kind"], "cache": g["cache"],
                        "compile_seconds": g["compile_seconds"], "shapes": g["input_shapes"],
                        "changed": changed, "dynamo_guard": guard,
                        "reason": f"{guard} -> {reason}" if guard else reason})
        buckets += _suggest(fam, function, names)
    return {"recompiles": out, "buckets": buckets}


def _suggest(fam: list[dict[str, Any]], function: str, names: dict[tuple[int, int], str]
             ) -> list[dict[str, Any]]:
    sizes: dict[tuple[int, int], list[int]] = {}
    for g in fam:
        for i, shape in enumerate(g["input_shapes"]):
            for d, n in enumerate(shape):
                sizes.setdefault((i, d), []).append(int(n))
    out: list[dict[str, Any]] = []
    by_sizes: dict[tuple[int, ...], dict[str, Any]] = {}
    for (i, d), seen in sorted(sizes.items()):
        distinct = tuple(sorted(set(seen)))
        if len(distinct) < 2 or len(seen) != len(fam):
            continue
        suggestion = sorted(set(suggest_buckets(distinct)))
        if list(distinct) == suggestion:  # already bucketed: one graph per bucket is the floor
            continue
        if distinct in by_sizes:
            by_sizes[distinct]["also"].append(f"input {i} dim {d}")
            continue
        entry = {"function": function, "input": i, "dim": d, "name": names.get((i, d)),
                 "sizes": list(distinct), "buckets": suggestion, "graphs_now": len(distinct),
                 "graphs_with_buckets": len(suggestion), "also": []}
        by_sizes[distinct] = entry
        out.append(entry)
    return out
