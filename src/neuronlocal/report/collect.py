"""What a run gathers: compiled graphs, recompiles, graph breaks, fallbacks, memory, traffic.

Most numbers are already counted elsewhere (compile metrics, the C++ op counters, the
allocator); this module adds what only exists *during* the run and would otherwise be lost:
the user's source line of each CPU fallback (the C++ core calls a hook at each op's first
fallback, on the thread running it: report/sites.py reads the program's line from its
stack, through compiled graphs' nodes and checkpoint recomputes; the one warning per op
fills in a backward op run where no Python frame is), graph breaks with their user frame
(Dynamo's `graph_breaks` log artifact), and the allocator's memory timeline per core.
`snapshot()` turns all of it into one JSON-able dict, the unit that is rendered and merged.
"""

from __future__ import annotations

import linecache
import logging
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from neuronlocal.core import counters as core_counters
from neuronlocal.core import state as core_state
from neuronlocal.estimate import capture as estimate_capture
from neuronlocal.memory import high_water_marks, reset_high_water_marks
from neuronlocal.report import analysis, sites

SCHEMA = 1
MAX_TIMELINE_POINTS = 1500
_FALLBACK = re.compile(r"^(\S+::\S+) executed via CPU fallback")
_BREAK_AT = re.compile(r"in user code at (.+?):(\d+)")
_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_EAGER = "Failed to handle graph break gracefully"  # Dynamo gave up on the whole function
_HEADERS = ("Encountered graph break", _EAGER, "Graph break encountered")


def _source(path: str, line: int) -> str:
    return linecache.getline(path, line).strip()


@dataclass
class _State:
    started: float = field(default_factory=time.time)
    fallback_sites: dict[str, dict[str, Any]] = field(default_factory=dict)
    breaks: list[dict[str, Any]] = field(default_factory=list)
    not_estimated: list[str] = field(default_factory=list)  # parts the report lacks, and why


class _BreakHandler(logging.Handler):
    """Keeps Dynamo's graph-break log records: reason text plus the user's file and line."""

    def __init__(self, state: _State) -> None:
        super().__init__(logging.DEBUG)
        self.state = state

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record must never break the user's run
            return
        where = _BREAK_AT.search(msg)
        reason = msg.split("Graph Break Reason:", 1)[-1].strip()
        path, line = (where.group(1), int(where.group(2))) if where else ("", 0)
        self.state.breaks.append({**break_parts(reason), "detail": reason[:2000], "file": path,
                                  "line": line, "source": _source(path, line) if path else ""})


def break_parts(reason: str) -> dict[str, Any]:
    """A graph break's kind, Dynamo's hints, and whether Dynamo ran the whole function eagerly.

    Dynamo's text is a header ("Encountered graph break when ...", or "Failed to handle graph
    break gracefully. Skipping the function and falling back to eager ..."), then the break's
    kind on a line of its own, then indented "Explanation:" and "Hint:" lines.
    """
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    eager = bool(lines) and lines[0].startswith(_EAGER)
    body = [ln for ln in lines if not ln.startswith(_HEADERS)]
    kind = body[0] if body else (lines[0] if lines else "?")
    hints = [ln.removeprefix("Hint:").strip() for ln in body if ln.startswith("Hint:")]
    return {"reason": kind[:200], "hint": " ".join(dict.fromkeys(hints)),
            "whole_function_eager": eager}


class Collector:
    """Starts capture for one run; `stop()` ends it. One at a time per process."""

    def __init__(self) -> None:
        self.state = _State()
        self._old_showwarning = warnings.showwarning
        self._handler = _BreakHandler(self.state)
        self._break_logger = logging.getLogger(_BREAK_LOGGER)
        self._old_level = self._break_logger.level
        self._old_propagate = self._break_logger.propagate
        self.estimate: estimate_capture.Capture | None = None

    def start(self, reset: bool = True) -> Collector:
        global _active
        from neuronlocal import _C
        from neuronlocal.core import dynamo_metrics as compile_metrics

        if reset:
            _C._clear_op_tracking()
            compile_metrics.reset_dynamo_metrics()
            core_counters.reset()
            for i in range(_C._device_count()):
                reset_high_water_marks(i)
                _C._reset_peak_snapshot(i)
        _C._set_timeline(True)
        _C._set_fallback_site_hook(self._on_fallback)
        self._break_logger.addHandler(self._handler)
        if self._break_logger.getEffectiveLevel() > logging.DEBUG:
            # Not asked for (TORCH_LOGS=graph_breaks or set_logs): collect the records here
            # without them reaching torch's stderr handler (dozens of V-lines per break).
            self._break_logger.setLevel(logging.DEBUG)
            self._break_logger.propagate = False
        # The C++ core warns once per fallback op; make sure that warning is shown (and so
        # seen here) even under an "ignore" or "default" filter that already saw it.
        warnings.filterwarnings("always", message=r"\S+::\S+ executed via CPU fallback")
        warnings.showwarning = self._showwarning
        self.state.started = time.time()
        try:  # estimated Trainium time per step and graph; the run goes on without it
            self.estimate = estimate_capture.start()
        except Exception as e:  # noqa: BLE001 - the observer never changes the outcome
            self.state.not_estimated.append(f"estimate: could not start: {type(e).__name__}: {e}")
        from neuronlocal.core import dryrun

        if dryrun.enabled():
            dryrun.arm_step_limit()  # after the estimate's hooks: its last step is closed
        _active = self
        return self

    def _on_fallback(self, op: str) -> bool:
        """The C++ core's hook, at an op's first CPU fallbacks: its site, from this stack.
        False: not the op's own line here, the core calls again at its next fallback."""
        try:
            found, own = sites.call_site(sys._getframe(1))
            if found is not None and (own or op not in self.state.fallback_sites):
                self.state.fallback_sites[op] = found
            return own
        except Exception:  # noqa: BLE001 - the observer never changes the outcome
            return True

    def _showwarning(self, message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: Any = None, line: str | None = None) -> None:
        m = _FALLBACK.match(str(message))
        if m and m.group(1) not in self.state.fallback_sites:
            # Where the hook saw no program frame (a backward op on autograd's device
            # thread): the warning replayed after backward, at the program's line of it.
            found = (sites.site(filename, lineno) if sites.is_program(filename)
                     else sites.call_site(sys._getframe(1))[0])
            self.state.fallback_sites[m.group(1)] = found or sites.site(filename, lineno)
        self._old_showwarning(message, category, filename, lineno, file, line)

    def stop(self) -> None:
        global _active
        from neuronlocal import _C

        _C._set_fallback_site_hook(None)
        if self.estimate is not None:
            self.estimate.stop()
        if warnings.showwarning == self._showwarning:
            warnings.showwarning = self._old_showwarning
        self._break_logger.removeHandler(self._handler)
        self._break_logger.setLevel(self._old_level)
        self._break_logger.propagate = self._old_propagate
        if _active is self:
            _active = None


_active: Collector | None = None


def _downsample(points: list[tuple[float, int]], limit: int = MAX_TIMELINE_POINTS
                ) -> list[list[float]]:
    """At most `limit` points, keeping each chunk's peak so the chart never hides one."""
    if len(points) <= limit:
        return [[round(t, 6), b] for t, b in points]
    step = -(-len(points) // limit)
    out = []
    for i in range(0, len(points), step):
        t, b = max(points[i:i + step], key=lambda p: p[1])
        out.append([round(t, 6), b])
    out.append([round(points[-1][0], 6), points[-1][1]])
    return out


def memory() -> list[dict[str, Any]]:
    """Per logical core that was used: peak, HBM size, OOM count, timeline."""
    from neuronlocal import _C

    cores = []
    for i in range(_C._device_count()):
        s = _C._memory_stats(i)
        timeline = list(_C._memory_timeline(i))
        if not s["allocation_requests"] and not timeline and not s["num_ooms"]:
            continue
        # The run's high-water marks: the program may have reset the peak counters.
        peak, reserved_peak = high_water_marks(i)
        cores.append({"core": i, "peak_bytes": peak,
                      "current_bytes": s["allocated_bytes.all.current"],
                      "reserved_peak_bytes": reserved_peak,
                      "hbm_bytes": s["hbm_bytes"], "num_ooms": s["num_ooms"],
                      "dry_ooms": s.get("dry_ooms", 0),
                      "timeline": _downsample(timeline)})
    return cores


def _fallbacks(sites: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    from neuronlocal.eager import tracking

    out = []
    traffic = tracking.get_fallback_traffic()
    for op, count in sorted(tracking.get_fallback_ops().items(), key=lambda kv: -kv[1]):
        site = sites.get(op, {"file": "", "line": 0, "source": ""})
        t = traffic.get(op, {})
        out.append({"op": op, "count": count, "to_host_bytes": t.get("to_host", 0),
                    "from_host_bytes": t.get("from_host", 0), **site})
    return out


def kernel_ops() -> dict[str, int]:
    """Executed ops that are kernels (nki_op, the kernel library): NKI kernels on Trainium,
    run on the NeuronCore as one fused kernel each."""
    from neuronlocal.eager import ops, tracking

    kernels = ops.device_kernels()
    return {op: n for op, n in tracking.get_executed_ops().items() if op in kernels}


def _breaks(captured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Graph breaks merged by site and kind, with Dynamo's counts when not captured."""
    from neuronlocal.core import dynamo_metrics as compile_metrics

    def key(b: dict[str, Any]) -> tuple[str, str, int, bool]:
        return b["reason"], b["file"], b["line"], b["whole_function_eager"]

    merged: dict[tuple[str, str, int, bool], dict[str, Any]] = {}
    for b in captured:
        merged.setdefault(key(b), {**b, "count": 0})["count"] += 1
    if not merged:
        for b in compile_metrics.graph_breaks():
            entry = {**break_parts(b["reason"]), "detail": b["reason"], "file": "", "line": 0,
                     "source": "", "count": b["count"]}
            merged[key(entry)] = entry
    return list(merged.values())


def _rank_world() -> tuple[int, int]:
    return core_counters.current_rank(), core_counters.world_size()


def counters() -> dict[str, int]:
    """Every counter of this process: compiles, cache hits, fallbacks, collectives, user ones."""
    from neuronlocal.core import dynamo_metrics as compile_metrics
    from neuronlocal.eager import tracking

    m = compile_metrics.get_dynamo_metrics()
    out = {
        "graphs": m["num_graphs"],
        "compiles": m["num_compiles"],
        "cache_hits": m["num_cache_hits"],
        "dynamo_recompiles": len(m["recompiles"]),
        "graph_breaks": sum(b["count"] for b in m["graph_breaks"]),
        "eager_ops": sum(tracking.get_executed_ops().values()),
        "fallback_ops": sum(tracking.get_fallback_ops().values()),
        "downcast_ops": sum(tracking.get_downcast_ops().values()),
    }
    for c in core_counters.get_collectives():
        out["collectives"] = out.get("collectives", 0) + c["count"]
        out["collective_bytes"] = out.get("collective_bytes", 0) + c["bytes"]
    out.update(core_counters.user_counters())
    return out


def _estimate_snapshot() -> dict[str, Any]:
    estimate = _active.estimate if _active is not None else None
    return estimate.snapshot() if estimate is not None else {}


def notes(world: int) -> list[str]:
    """Advice about how the run used its libraries, from what the Hugging Face glue counted."""
    from neuronlocal.core.config import ConfigError, env_flag

    c = core_counters.user_counters()
    out = []
    if c.get("hf_generate_bypassed_compile"):
        out.append("model.generate() ran uncompiled: torch.compile(model) wraps the model, but "
                   "generate() calls the model's own forward, never the wrapper. Compile the "
                   "forward instead: model.forward = torch.compile(model.forward, "
                   "backend=\"neuron\")")
    try:
        async_off = env_flag("HF_DEACTIVATE_ASYNC_LOAD", False)
    except ConfigError:  # a value transformers does not read as true either
        async_off = False
    if c.get("hf_weight_loads") and world > 1 and not async_off:
        out.append(f"transformers loaded weights with its threaded loader on {world} ranks "
                   "(HF_DEACTIVATE_ASYNC_LOAD unset): on Trainium that loader is known to "
                   "hang multi-rank jobs; set HF_DEACTIVATE_ASYNC_LOAD=1, as TorchNeuron's "
                   "guide does")
    return out


def _safe(what: str, fn: Callable[[], Any], default: Any, missing: list[str]) -> Any:
    """fn(), or `default` with "what: why" added to `missing` (a report section that fails
    is left out and says so; the run and the rest of the report go on)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the observer never changes the outcome
        missing.append(f"{what}: {type(e).__name__}: {e}"[:300])
        return default


def not_estimated(graphs: list[dict[str, Any]], estimate: dict[str, Any]) -> list[str]:
    """Why parts of the estimate are missing: per graph, then the eager capture's own."""
    out = [f"graph {g['graph_name']}: {g['estimate']['not_estimated']}" for g in graphs
           if (g.get("estimate") or {}).get("not_estimated")]
    out += [f"graph {g['graph_name']}: higher-order operators without their cost: "
            + ", ".join(g["estimate"]["uncounted"]) for g in graphs
            if (g.get("estimate") or {}).get("uncounted")]
    return out + list(estimate.get("not_estimated") or [])


def _dry_run() -> dict[str, Any] | None:
    """A dry run's own records: values assumed, model state, collectives by group size."""
    from neuronlocal import _C
    from neuronlocal.core import dryrun

    if not dryrun.enabled():
        return None
    peaks = [{"core": i, **dryrun.peak(i)} for i in range(_C._device_count())
             if _C._memory_stats(i)["allocation_requests"]]
    return {"reads": dryrun.reads(), "model_state": dryrun.model_state(),
            "steps": dryrun.steps(), "collective_groups": core_counters.get_collective_groups(),
            "peaks": peaks}


def snapshot(run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of this process so far, as plain data (one rank of a run)."""
    from neuronlocal.core import dynamo_metrics as compile_metrics
    from neuronlocal.eager import tracking

    state = _active.state if _active is not None else _State(started=time.time())
    missing = list(state.not_estimated)
    empty = {"graphs": [], "recompiles": [], "graph_breaks": [], "compile_seconds": 0.0}
    dyn = _safe("compiled graphs", compile_metrics.get_dynamo_metrics, empty, missing)
    graphs = dyn["graphs"]
    families = _safe("recompile analysis", lambda: analysis.recompiles(
        graphs, dyn["recompiles"], {str(m.compile_id): m for m in
                                    torch._dynamo.utils.get_compilation_metrics()}),
        {"recompiles": [], "buckets": [], "advice": []}, missing)
    estimate = _safe("estimate", _estimate_snapshot, {}, missing)
    rank, world = _rank_world()
    return {
        "schema": SCHEMA,
        "rank": rank,
        "world_size": world,
        "run": {"argv": list(sys.argv), "started": state.started,
                "seconds": round(time.time() - state.started, 3), "exit_code": None,
                "error": None, **(run or {})},
        "instance": core_state.profile.describe(),
        "config_error": (f"neuron device unavailable: {core_state.config_error}"
                         if core_state.config_error else None),
        "graphs": graphs,
        "compile_seconds": round(dyn["compile_seconds"], 3),
        "recompiles": families["recompiles"],
        "dynamo_recompiles": dyn["recompiles"],
        "bucket_suggestions": families["buckets"],
        "recompile_advice": families["advice"],
        "graph_breaks": _safe("graph breaks", lambda: _breaks(state.breaks), [], missing),
        "fallback_ops": _safe("fallback ops", lambda: _fallbacks(state.fallback_sites), [],
                              missing),
        "downcast_ops": dict(sorted(tracking.get_downcast_ops().items())),
        "eager_ops": dict(sorted(tracking.get_executed_ops().items(), key=lambda kv: -kv[1])),
        "kernel_ops": _safe("kernel ops", kernel_ops, {}, missing),
        "kernel_swaps": core_counters.get_kernel_swaps(),
        "memory": _safe("memory", memory, [], missing),
        "collectives": core_counters.get_collectives(),
        "dry_run": _safe("dry run", _dry_run, None, missing),
        "counters": _safe("counters", counters, {}, missing),
        "estimate": estimate,
        "notes": _safe("notes", lambda: notes(world), [], missing),
        "not_estimated": missing + _safe("estimate", lambda: not_estimated(graphs, estimate),
                                         [], missing),
    }
