"""Why each graph was compiled again, in the user's terms, and what would stop it.

Two mechanisms recompile on neuron: Dynamo itself (a guard fails and it traces the frame
again, often into a symbolic graph), and the neuron backend, which compiles a symbolic graph
once per concrete shape (kind="specialized"), as Trainium compiles static shapes only.

Graphs are grouped by the Dynamo frame they came from and compared by Dynamo's source name
of each input (`L['kwargs']['input_ids']`, `L['self']...weight`, recorded at compile time),
never by position: a decode graph has other inputs than its prefill. Inputs are data (token
ids, masks, positions, pixel values, the function's own tensor arguments), a cache (a static
KV cache's tensors) or weights (parameters and buffers of a module). Each graph has a role:
training (grad on, an input requires grad), prefill or decode (a cache is an input; decode
feeds one token), or other. Each recompile gets one line naming the user-level cause, with
Dynamo's failed guard kept beside it; buckets are suggested for data inputs only, and a
static cache whose length changed gets a `max_cache_len` that covers every call.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from neuronlocal.compile.bucketing import bucket_for, suggest_buckets

_CID = re.compile(r"(\d+)/(\d+)")
_TENSOR = re.compile(r"tensor '([^']+)' size mismatch at index (\d+)")
_CACHE = re.compile(r"\['(cache|past_key_values|cache_params)'\]|past_key_values|key_cache|"
                    r"value_cache")
_WEIGHT = re.compile(r"\._(parameters|buffers)\[|^G\[|^L\['self'\]|^L\['args'\]\[0\]\._modules")
_TOKENS = ("input_ids", "inputs_embeds", "decoder_input_ids")
_LEAF = re.compile(r"\['([^']+)'\]$|\.(\w+)$")


@dataclass(frozen=True)
class _Input:
    index: int
    source: str  # Dynamo's source name, or "input <i>" where the record has none
    name: str  # the short name shown: input_ids, cache, weight
    category: str  # "data", "cache" or "weight"
    shape: tuple[int, ...]


def _category(source: str) -> str:
    if _CACHE.search(source):
        return "cache"
    return "weight" if _WEIGHT.search(source) else "data"


def _leaf(source: str) -> str:
    m = _LEAF.search(source)
    return next((x for x in m.groups() if x), source) if m else source


def _inputs(g: dict[str, Any]) -> list[_Input]:
    names = g.get("extra", {}).get("input_names") or []
    shapes = [tuple(int(n) for n in s) for s in g["input_shapes"]]
    if len(names) != len(shapes):  # no source names: position is all there is
        return [_Input(i, f"input {i}", f"input {i}", "data", s) for i, s in enumerate(shapes)]
    return [_Input(i, n, _leaf(n), _category(n), s)
            for i, (n, s) in enumerate(zip(names, shapes, strict=True))]


def _tokens(ins: list[_Input]) -> int | None:
    tok = next((x for x in ins if x.category == "data" and x.name in _TOKENS
                and len(x.shape) >= 2), None)
    return tok.shape[1] if tok is not None else None


def _cache_len(ins: list[_Input]) -> int | None:
    """The length of a static cache fed to the graph (dim -2 of its key/value tensors)."""
    kv = next((x for x in ins if x.category == "cache" and len(x.shape) >= 3), None)
    return kv.shape[-2] if kv is not None else None


def role(g: dict[str, Any], ins: list[_Input]) -> str:
    """training, prefill, decode or other."""
    if g.get("extra", {}).get("training"):
        return "training"
    cached = any(x.category == "cache" for x in ins) or any(
        x.name == "cache_position" for x in ins)
    if cached and (tokens := _tokens(ins)) is not None:
        return "decode" if tokens == 1 else "prefill"
    return "other"


def _compile_id(g: dict[str, Any]) -> tuple[str, int | None, int | None]:
    cid = str(g.get("extra", {}).get("compile_id", ""))
    m = _CID.search(cid)
    if m:
        return f"frame {m.group(1)}", int(m.group(1)), int(m.group(2))
    base = g["graph_name"].rsplit("_", 1)[0]
    return f"{base}/{len(g['input_shapes'])} inputs", None, None


def _function(g: dict[str, Any], frame: int | None, compile_ids: dict[str, Any]
              ) -> tuple[str, str]:
    """(the user's line that led to the compile, not a library wrapper's; the function Dynamo
    compiled, which may be such a wrapper)."""
    compiled = next((f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})"
                     for cid, m in compile_ids.items()
                     if (hit := _CID.search(cid)) and frame is not None
                     and int(hit.group(1)) == frame), "?")
    user = g.get("extra", {}).get("user_frame")
    if not user:
        return compiled, compiled
    return f"{user['function']} ({user['file']}:{user['line']})", compiled


def guard_line(reason: str | None) -> str | None:
    """Dynamo's failed guard in one line: `len(kwargs) == 6  # deprecation.py:134 in f`."""
    if not reason:
        return None
    first = re.sub(r"^\d+/\d+: ", "", reason.strip().splitlines()[0])
    parts = [p.strip() for p in re.split(r"\s{2,}#\s*", first)]  # guard, source, location
    return (parts[0] + (f"  # {parts[-1]}" if len(parts) > 1 else ""))[:240]


def _guard(g: dict[str, Any], compile_ids: dict[str, Any], seen: set[str]) -> str | None:
    """Dynamo's recompile reason, on the first graph of a frame's second+ compile only."""
    cid = str(g.get("extra", {}).get("compile_id", ""))
    m = _CID.search(cid)
    if not m or int(m.group(2)) == 0 or cid in seen:
        return None
    seen.add(cid)
    metric = compile_ids.get(m.group(0))
    return getattr(metric, "recompile_reason", None) if metric is not None else None


def _changes(before: list[_Input], after: list[_Input]) -> list[dict[str, Any]]:
    """Dimensions that changed between inputs of the same source name."""
    old = {x.source: x for x in before}
    out: list[dict[str, Any]] = []
    for x in after:
        y = old.get(x.source)
        if y is None or y.shape == x.shape:
            continue
        base = {"input": x.index, "name": x.name, "source": x.source, "category": x.category}
        if len(y.shape) != len(x.shape):
            out.append({**base, "dim": -1, "before": len(y.shape), "after": len(x.shape)})
            continue
        out += [{**base, "dim": d, "before": a, "after": b}
                for d, (a, b) in enumerate(zip(y.shape, x.shape, strict=True)) if a != b]
    return out


@dataclass
class _Graph:
    g: dict[str, Any]
    ins: list[_Input]
    role: str
    cache_len: int | None


def recompiles(graphs: list[dict[str, Any]], dynamo_recompiles: list[dict[str, Any]],
               compile_ids: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """{"recompiles": one entry per recompiled graph, "buckets": suggestions per data
    dimension, "advice": per frame, the graphs now and with every suggestion applied}."""
    families: dict[str, list[_Graph]] = defaultdict(list)
    frames: dict[str, int | None] = {}
    for g in sorted(graphs, key=lambda g: g["graph_id"]):
        key, frame, _ = _compile_id(g)
        ins = _inputs(g)
        families[key].append(_Graph(g, ins, role(g, ins), _cache_len(ins)))
        frames[key] = frame
    out: dict[str, list[dict[str, Any]]] = {"recompiles": [], "buckets": [], "advice": []}
    seen: set[str] = set()
    for key, fam in families.items():
        function, compiled = _function(fam[0].g, frames[key], compile_ids)
        guards = [_guard(x.g, compile_ids, seen) for x in fam]
        buckets = _suggest(fam, function, guards)
        cache = _max_cache_len(fam, buckets)
        for i, x in enumerate(fam[1:], 1):
            out["recompiles"].append({**_explain(fam[:i], x, guards[i], function, buckets,
                                                  cache), "compiled": compiled})
        out["buckets"] += buckets
        if cache is not None or buckets:
            out["advice"].append({"function": function, "graphs_now": len(fam),
                                  "graphs_predicted": _predict(fam, buckets, cache),
                                  "max_cache_len": cache,
                                  "buckets": {b["name"]: b["buckets"] for b in buckets}})
    return out


def _explain(earlier: list[_Graph], x: _Graph, guard: str | None, function: str,
             buckets: list[dict[str, Any]], cache: int | None) -> dict[str, Any]:
    same_role = [e for e in earlier if e.role == x.role]
    prev = same_role[-1] if same_role else earlier[-1]
    changed = _changes(prev.ins, x.ins)
    same_as = next((e.g["graph_name"] for e in same_role
                    if e.g["input_shapes"] == x.g["input_shapes"]), None)
    # The backend compiling one symbolic graph per shape: automatic dynamic shapes (or
    # mark_dynamic) at work. A new Dynamo compile with the same shapes had another cause,
    # which its failed guard names.
    symbolic = x.g["kind"] == "specialized" or any(
        _compile_id(e.g)[0] == _compile_id(x.g)[0] and _compile_id(e.g)[2] is not None
        and _compile_id(e.g)[2] == _compile_id(x.g)[2] for e in earlier)
    if not same_role:
        cause = (f"first {x.role} graph of this function (after a {earlier[-1].role} graph): "
                 "its inputs differ, one graph per role is expected")
    elif same_as and (symbolic or guard is None):
        cause = (f"{x.role} graph compiled again with the shapes of {same_as}: Dynamo's "
                 "automatic dynamic shapes made a symbolic graph, which neuron compiles per "
                 "shape (set torch._dynamo.config.automatic_dynamic_shapes = False)")
    elif changed:
        cause = f"{x.role} graph recompiled: " + _cause(changed, prev, x, buckets, cache)
    elif prev.g["input_dtypes"] != x.g["input_dtypes"]:
        cause = f"{x.role} graph recompiled: input dtypes changed"
    elif guard:
        cause = f"{x.role} graph recompiled with the same shapes: {_guard_cause(guard)}"
    else:
        cause = (f"{x.role} graph recompiled with the same shapes and dtypes: grad mode, graph "
                 "code or guards changed")
    raw = guard_line(guard)
    return {"graph": x.g["graph_name"], "function": function, "role": x.role,
            "kind": x.g["kind"], "cache": x.g["cache"],
            "compile_seconds": x.g["compile_seconds"], "shapes": x.g["input_shapes"],
            "changed": changed, "dynamo_guard": guard, "guard": raw, "reason": cause,
            "compared_with": prev.g["graph_name"]}


def _guard_cause(guard: str) -> str:
    """What Dynamo's failed guard means, for a recompile no shape or dtype explains."""
    line = guard_line(guard) or guard
    low = line.lower()
    if "dispatch key set" in low or "type" in low or "subclass" in low:
        what = ("an input's type changed (a tensor subclass such as AsyncCollectiveTensor or "
                "DTensor where a plain tensor was, or the reverse)")
    elif "grad_mode" in low or "global_state" in low or "global state" in low:
        what = "grad mode or another global setting changed"
    elif "requires_grad" in low:
        what = "an input's requires_grad changed"
    elif "___check_obj_id" in low or "id(" in low:
        what = "an object Dynamo guards by identity was replaced"
    else:
        what = "a guard of Dynamo failed"
    return f"{what}; Dynamo's guard: {line}"


def _cause(changed: list[dict[str, Any]], prev: _Graph, x: _Graph,
           buckets: list[dict[str, Any]], cache: int | None) -> str:
    parts, advice = [], []
    if prev.cache_len is not None and x.cache_len is not None and prev.cache_len != x.cache_len:
        parts.append(f"static cache length {prev.cache_len} -> {x.cache_len}")
        if cache is not None:
            advice.append(f"set max_cache_len={cache}")
    follows = {prev.cache_len, x.cache_len}
    by_change: dict[tuple[int, int], list[str]] = defaultdict(list)
    for c in changed:
        if c["category"] == "cache" or (c["before"] in follows and c["after"] in follows):
            continue  # the cache's own tensors, and masks sized like the cache
        if c["name"] not in by_change[(c["before"], c["after"])]:
            by_change[(c["before"], c["after"])].append(c["name"])
    for (a, b), names in by_change.items():
        what = "prompt length" if x.role == "prefill" and set(names) & set(_TOKENS) else \
            ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        parts.append(f"{what} {a} -> {b}")
    for bk in buckets:
        if bk["role"] == x.role and any(n in bk["names"] for names in by_change.values()
                                        for n in names):
            sizes = ", ".join(map(str, bk["buckets"]))
            advice.append(f"pad prompts to buckets {sizes} (bucketing.pad_to_bucket(ids, "
                          f"[{sizes}], side='left'), with its attention_mask)"
                          if x.role == "prefill" and bk["name"] in _TOKENS else
                          f"pad {bk['name']} to buckets {sizes} (bucketing.pad_to_bucket)")
    if any(c["category"] == "weight" for c in changed):
        parts.append("weights changed shape (another model?)")
    text = ", ".join(parts) or "shapes changed"
    return text + ("; " + " and ".join(dict.fromkeys(advice)) if advice else "")


def _suggest(fam: list[_Graph], function: str, guards: list[str | None]
             ) -> list[dict[str, Any]]:
    """Buckets for data dimensions that took several sizes within one role (never weights,
    caches or dimensions that follow the cache length)."""
    guard_names = {int(i): n for gd in guards if gd for n, i in _TENSOR.findall(gd)}
    out: list[dict[str, Any]] = []
    for r in dict.fromkeys(x.role for x in fam):
        members = [x for x in fam if x.role == r]
        caches = {x.cache_len for x in members}
        sizes: dict[tuple[str, int], list[int]] = defaultdict(list)
        first: dict[tuple[str, int], _Input] = {}
        for x in members:
            for inp in x.ins:
                if inp.category != "data":
                    continue
                for d, n in enumerate(inp.shape):
                    sizes[(inp.source, d)].append(n)
                    first.setdefault((inp.source, d), inp)
        by_sizes: dict[tuple[int, ...], dict[str, Any]] = {}
        for (src, d), seen in sizes.items():
            distinct = tuple(sorted(set(seen)))
            if len(distinct) < 2 or len(seen) != len(members) or set(distinct) <= caches:
                continue
            suggestion = _fewer_graphs(distinct)
            if suggestion is None:  # already bucketed: one graph per bucket is the floor
                continue
            inp = first[(src, d)]
            if distinct in by_sizes:
                by_sizes[distinct]["also"].append(f"{inp.name} dim {d}")
                by_sizes[distinct]["names"].append(inp.name)
                continue
            name = guard_names.get(d, inp.name) if inp.source.startswith("input ") else inp.name
            entry = {"function": function, "role": r, "input": inp.index, "dim": d,
                     "name": name, "source": src, "sizes": list(distinct),
                     "buckets": suggestion, "graphs_now": len(distinct),
                     "graphs_with_buckets": len({bucket_for(n, suggestion) for n in distinct}),
                     "also": [], "names": [inp.name]}
            by_sizes[distinct] = entry
            out.append(entry)
    return out


def _fewer_graphs(distinct: tuple[int, ...]) -> list[int] | None:
    """suggest_buckets' set for the sizes seen, or where that compiles as many graphs as now,
    the largest smaller set that compiles fewer. None: the sizes are already buckets."""
    if sorted(set(suggest_buckets(distinct))) == list(distinct):
        return None
    for most in range(min(4, len(distinct)), 0, -1):
        suggestion = sorted(set(suggest_buckets(distinct, max_buckets=most)))
        if len({bucket_for(n, suggestion) for n in distinct}) < len(distinct):
            return suggestion
    return None


def _bucketed(x: _Graph, buckets: list[dict[str, Any]], cache: int | None) -> tuple[Any, ...]:
    """The graph's data shapes once the suggestions are applied (its graph key then)."""
    follows = {x.cache_len} if cache is not None else set()
    maps = {(b["role"], n): b for b in buckets for n in b["names"]}
    key: list[Any] = [x.role]
    for inp in x.ins:
        if inp.category != "data":
            continue
        b = maps.get((x.role, inp.name))
        key.append(tuple("cache" if n in follows else
                         bucket_for(n, b["buckets"]) if b is not None and d == b["dim"] else n
                         for d, n in enumerate(inp.shape)))
    return tuple(key)


def _predict(fam: list[_Graph], buckets: list[dict[str, Any]], cache: int | None) -> int:
    return len({_bucketed(x, buckets, cache) for x in fam})


def _max_cache_len(fam: list[_Graph], buckets: list[dict[str, Any]]) -> int | None:
    """A `max_cache_len` that holds every generate() call seen, prompts padded to their
    buckets: per call, the padded prompt plus the tokens it generated (the cache length its
    decode graph had, less its prompt), rounded up to a multiple of 8. None when the cache
    length never changed."""
    lens = {x.cache_len for x in fam if x.cache_len is not None}
    if len(lens) < 2:
        return None
    prompt = next((b for b in buckets if b["role"] == "prefill" and b["dim"] == 1
                   and set(b["names"]) & set(_TOKENS)), None)
    need, last_prompt = max(lens), None
    for x in fam:
        if x.role == "prefill":
            last_prompt = _tokens(x.ins)
        elif x.role == "decode" and x.cache_len is not None and last_prompt is not None:
            padded = bucket_for(last_prompt, prompt["buckets"]) if prompt else last_prompt
            need = max(need, padded + x.cache_len - last_prompt)
    return max(suggest_buckets([need]))
