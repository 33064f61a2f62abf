"""Compile metrics: one record per compiled graph, plus Dynamo's recompiles and graph breaks.

`get_dynamo_metrics()` mirrors TorchNeuron's helper of that name: graph id, name, node count,
input shapes, compile seconds, cache hit or miss, has-collectives. Recompile reasons (the
guard that failed) and graph breaks (with reasons) come from Dynamo's own records.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GraphRecord:
    graph_id: int
    graph_name: str
    model_name: str | None
    node_count: int
    input_shapes: list[tuple[int, ...]]
    input_dtypes: list[str]
    compile_seconds: float
    cache: str  # "hit" (memory or disk) or "miss"
    cache_key: str
    has_collectives: bool
    kind: str = "static"  # "static", or "specialized" when cut from a symbolic Dynamo graph
    extra: dict[str, Any] = field(default_factory=dict)
    # Estimated Trainium seconds per call, with band and top nodes (neuronlocal.estimate).
    estimate: dict[str, Any] = field(default_factory=dict)
    # Computes `estimate` when first asked for (the estimator's fake run is not paid by a
    # compile nobody reports on).
    pending_estimate: Callable[[], dict[str, Any]] | None = field(default=None, repr=False)

    def resolve_estimate(self) -> dict[str, Any]:
        fn, self.pending_estimate = self.pending_estimate, None
        if fn is not None:
            try:
                self.estimate = fn()
            except Exception as e:  # noqa: BLE001 - an estimate never breaks metrics
                self.estimate = {"not_estimated": f"{type(e).__name__}: {e}"[:300]}
        return self.estimate

    def as_dict(self) -> dict[str, Any]:
        self.resolve_estimate()
        d = dataclasses.asdict(self)
        del d["pending_estimate"]
        return d


_lock = threading.Lock()
_records: list[GraphRecord] = []
_model_name: str | None = None


def set_model_name(name: str | None) -> None:
    """Names the graphs compiled from now on (TorchNeuron's `set_model_name`)."""
    global _model_name
    _model_name = name


def get_model_name() -> str | None:
    return _model_name


def next_graph_id() -> int:
    """The id the next graph gets: the number of graphs recorded so far. Counting with it
    costs nothing, where `get_dynamo_metrics()` computes every pending estimate."""
    with _lock:
        return len(_records)


def last_graph_name() -> str:
    """The name of the graph recorded last (the profiler range of its calls)."""
    with _lock:
        return _records[-1].graph_name if _records else "graph"


def last_record() -> GraphRecord | None:
    """The graph recorded last (the estimator annotates it right after its compile)."""
    with _lock:
        return _records[-1] if _records else None


def compile_seconds_total() -> float:
    """Compile seconds of every graph recorded so far (no estimate is resolved: cheap enough
    to read at every training step)."""
    with _lock:
        return sum(r.compile_seconds for r in _records)


def record(rec: GraphRecord) -> None:
    with _lock:
        _records.append(rec)


def _source_name(node: Any) -> str | None:
    """Dynamo's name of a graph input (`L['input_ids']`, `L['self']...weight`), if known."""
    src = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(src, "name", None)
    name = name() if callable(name) else name
    return name if isinstance(name, str) else None


_LIBRARY = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
                 | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})


def is_library(path: str) -> bool:
    """Whether a code file is Python's or an installed library's (transformers' wrappers,
    torch, neuronlocal): not a line of the user's program."""
    return os.path.abspath(path).startswith(_LIBRARY)


def user_frame() -> dict[str, Any] | None:
    """The innermost caller outside Python's and installed libraries (transformers'
    wrappers, torch, neuronlocal): the line of the user's program that led here."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_library(frame.f_code.co_filename):
            return {"file": frame.f_code.co_filename, "line": frame.f_lineno,
                    "function": frame.f_code.co_name}
        frame = frame.f_back  # type: ignore[assignment]
    return None


def graph_facts(gm: Any) -> dict[str, Any]:
    """What the run report compares graphs by, from a Dynamo graph: the source name of
    each tensor input (in input order), whether it trains, and the user's calling line.
    Never raises: a graph whose facts cannot be read is compared by shapes only."""
    try:
        return _facts(gm)
    except Exception as e:  # noqa: BLE001 - the observer never changes the outcome
        return {"facts_error": f"not recorded: {type(e).__name__}: {e}"[:200]}


def _facts(gm: Any) -> dict[str, Any]:
    values = [(n, n.meta.get("example_value", n.meta.get("val"))) for n in gm.graph.nodes
              if n.op == "placeholder"]
    tensors = [(n, v) for n, v in values if isinstance(v, torch.Tensor)]
    names = [_source_name(n) for n, _ in tensors]
    return {"input_names": names if all(names) else [],
            "training": torch.is_grad_enabled() and any(v.requires_grad for _, v in tensors),
            "user_frame": user_frame()}


def get_dynamo_metrics() -> dict[str, Any]:
    """Everything the compiler did in this process, as plain data."""
    with _lock:
        records = list(_records)
    graphs = [r.as_dict() for r in records]  # outside the lock: estimates may compile-free run
    return {
        "graphs": graphs,
        "num_graphs": len(graphs),
        "num_compiles": sum(1 for g in graphs if g["cache"] == "miss"),
        "num_cache_hits": sum(1 for g in graphs if g["cache"] != "miss"),
        "compile_seconds": sum(g["compile_seconds"] for g in graphs),
        "recompiles": recompile_reasons(),
        "graph_breaks": graph_breaks(),
    }


def reset_dynamo_metrics() -> None:
    with _lock:
        _records.clear()
    torch._dynamo.utils.counters["graph_break"].clear()
    torch._dynamo.utils.clear_compilation_metrics()


def recompile_reasons() -> list[dict[str, Any]]:
    """Dynamo's recompilations: the function and the guard that failed (e.g. a size)."""
    out = []
    for m in torch._dynamo.utils.get_compilation_metrics():
        reason = getattr(m, "recompile_reason", None)
        if reason:
            out.append({"function": m.co_name, "reason": reason, "frame_key": m.frame_key})
    return out


def graph_breaks() -> list[dict[str, Any]]:
    """Graph breaks seen by Dynamo, with their reasons and counts."""
    return [{"reason": reason, "count": count}
            for reason, count in torch._dynamo.utils.counters["graph_break"].items()]
