"""Estimated Trainium time of what a program runs, while `neuronlocal run` or `check` captures.

Compiled graphs: `attach` (called once per compiled graph by the compile backend) stores the
graph's estimate on its compile record and wraps the compiled callable so that, only while
a capture is active, its calls and host seconds are counted. Eager work: a dispatch mode
costs every op that touches a neuron tensor, and global optimizer step hooks cut the run
into training steps (one per outermost optimizer step). Outside a capture nothing is
installed, so nothing is slowed down.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from neuronlocal.core.counters import launcher_count
from neuronlocal.core.steps import OuterSteps
from neuronlocal.estimate.counting import Counter, Tally
from neuronlocal.estimate.overlap import Timeline

log = logging.getLogger("neuronlocal.estimate")
_graphs: dict[int, dict[str, Any]] = {}  # graph_id -> {"name", "record" (its GraphRecord)}
_active: Capture | None = None


def attach(gm: Any, example_inputs: Any, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Estimates the graph just recorded by the compile metrics; returns `compiled` wrapped
    to count calls during a capture. Never raises: a failed estimate is recorded as such."""
    from neuronlocal.core import dynamo_metrics as metrics

    rec = metrics.last_record()
    if rec is None:
        return compiled
    try:
        from neuronlocal.estimate import graph_cost_later

        rec.pending_estimate = graph_cost_later(gm, list(example_inputs))
        if _active is not None:  # a capture reports on it: estimate now, as compiled
            _resolve(rec)
    except Exception as e:  # noqa: BLE001 - an estimate must never break a compile
        rec.estimate = {"not_estimated": f"{type(e).__name__}: {e}"[:300]}
        log.debug("no estimate for %s: %s", rec.graph_name, e)
    return counted(rec, compiled)


def counted(rec: Any, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` wrapped to count its calls as calls of the graph of `rec` during a capture
    (also for a graph's second compiled form: the tiered compiler's switch)."""
    gid = rec.graph_id
    _graphs[gid] = {"name": rec.graph_name, "record": rec}

    def run(*args: Any) -> Any:
        cap = _active
        if cap is None:
            return compiled(*args)
        start = time.perf_counter()
        try:
            return compiled(*args)
        finally:
            cap.graph_called(gid, time.perf_counter() - start)

    return run


def _resolve(rec: Any) -> dict[str, Any]:
    """The record's estimate, computed now if still pending (the fake run is not eager work
    of the program, so an active capture does not count it)."""
    cap = _active
    if cap is None or rec.pending_estimate is None:
        return rec.resolve_estimate()
    with cap.counter.paused():
        return rec.resolve_estimate()


def _estimate(gid: int) -> dict[str, Any]:
    rec = _graphs.get(gid, {}).get("record")
    return _resolve(rec) if rec is not None else {}


def _compile_seconds() -> float:
    from neuronlocal.core import dynamo_metrics

    return dynamo_metrics.compile_seconds_total()


def _graph_seconds(gid: int) -> float:
    est = _estimate(gid)
    return float(est.get("seconds", 0.0)) + float(est.get("backward_seconds", 0.0))


class StepWindow:
    """The step records of a run, bounded for any run length: the first HEAD and the last
    TAIL steps are kept whole; every step is counted in `total` and summed in `sums`, so a
    million-step run keeps a rank file of ~(HEAD + TAIL) records and says how many were
    summarised."""

    HEAD = 50
    TAIL = 1000
    SUMMED = ("host_s", "compile_s", "estimated_s", "eager_s", "graph_s", "eager_ops",
              "eager_launches", "launch_s", "compiled_s", "graph_calls", "tensor_flops")

    def __init__(self) -> None:
        self.head: list[dict[str, Any]] = []
        self.tail: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.TAIL)
        self.total = 0
        self.sums: dict[str, float] = dict.fromkeys(self.SUMMED, 0.0)

    def append(self, step: dict[str, Any]) -> None:
        self.total += 1
        for k in self.SUMMED:
            self.sums[k] += float(step.get(k, 0.0))
        (self.head if len(self.head) < self.HEAD else self.tail).append(step)

    def kept(self) -> list[dict[str, Any]]:
        return [*self.head, *self.tail]


class Capture:
    """Costs eager neuron ops and compiled-graph calls, step by step (optimizer steps)."""

    def __init__(self) -> None:
        self.counter = Counter(replace_attention=False, only_device="neuron")
        self.steps = StepWindow()
        self.calls: dict[int, list[float]] = {}  # graph_id -> [calls, host seconds], whole run
        self._step_calls: dict[int, int] = {}
        self._mark = time.perf_counter()
        self._compile_mark = 0.0  # compile seconds recorded when the step began
        self._hooks: list[Any] = []
        self._stepping = OuterSteps()  # one training step per outermost optimizer step
        self.errors: list[str] = []  # what could not be estimated, and why

    def start(self) -> Capture:
        global _active

        self.counter.timeline = Timeline()
        self.counter.__enter__()
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._hooks = [register_optimizer_step_pre_hook(self._on_step_start),
                       register_optimizer_step_post_hook(self._on_step)]
        self._mark = time.perf_counter()
        self._compile_mark = _compile_seconds()
        _active = self
        return self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
            self.counter.__exit__(None, None, None)
            for hook in self._hooks:
                hook.remove()

    def graph_called(self, gid: int, host_s: float) -> None:
        entry = self.calls.setdefault(gid, [0, 0.0])
        entry[0] += 1
        entry[1] += host_s
        self._step_calls[gid] = self._step_calls.get(gid, 0) + 1
        if self.counter.timeline is not None:
            self.counter.timeline.graph(gid)

    def failed(self, what: str, e: BaseException) -> None:
        """Records a failure of the estimate itself; the program goes on as without it."""
        why = f"{what}: {type(e).__name__}: {e}"[:300]
        if why not in self.errors:
            self.errors.append(why)
        log.debug("not estimated: %s", why)

    def _on_step_start(self, opt: Any, *_: Any) -> None:
        if self._stepping.begin(opt) and self.counter.timeline is not None:
            self.counter.timeline.barrier()  # the update needs every gradient reduced

    def _on_step(self, opt: Any, *_: Any) -> None:
        if not self._stepping.end(opt):
            return  # an inner optimizer of a step still running
        try:  # an optimizer hook: a failure here would end the user's step
            self._step(opt)
        except Exception as e:  # noqa: BLE001 - the observer never changes the outcome
            self.failed("training step", e)

    def _step(self, opt: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        if params and all(p.device.type != "neuron" for p in params):
            self._close()  # a host-only optimizer (a CPU reference model): a boundary only
            return
        self.steps.append(self._close())

    def _close(self) -> dict[str, Any]:
        from neuronlocal.estimate import FACTORS, band_width, emulated
        from neuronlocal.estimate.overlap import step_seconds
        from neuronlocal.estimate.roofline import eager_factors, eager_launch, launches, seconds

        now = time.perf_counter()
        compiled = _compile_seconds()
        tally, self.counter.tally = self.counter.tally, Tally()
        tokens, self.counter.tokens = self.counter.tokens, 0
        timeline, self.counter.timeline = self.counter.timeline, Timeline()
        sharers, self.counter.token_sharers = self.counter.token_sharers, 1
        spec, w = emulated(), band_width("train")
        node = launcher_count("LOCAL_WORLD_SIZE", 0, minimum=1) or None  # torchrun's layout
        # Eager work as TorchNeuron runs it: each op alone (no fusion) plus its own kernel
        # launch; and the same ops compiled, as the calibrated model costs a step: fused,
        # one graph launch.
        n = launches(tally)
        per, low, high = eager_launch(FACTORS)
        roof = seconds(tally, spec, eager_factors(FACTORS), node) if tally.ops else 0.0
        comm = Tally()
        for op, k in tally.ops.items():
            if op.engine == "comm":
                comm.add(op, k)
        comm_s = seconds(comm, spec, eager_factors(FACTORS), node) if comm.ops else 0.0
        eager = roof + n * per
        fused = seconds(tally, spec, FACTORS, node) + FACTORS.launch if n else 0.0
        graphs = sum(_graph_seconds(g) * k for g, k in self._step_calls.items())
        est = eager + graphs
        band = [(roof + graphs) / (1 + w) + n * low, (roof + graphs) * (1 + w) + n * high]
        # The same ops with the collectives that run alongside compute overlapped
        # (overlap.py); equal to the serial figure when none does.
        lapped, lapped_low, aside = est, band[0], 0.0
        if timeline is not None and timeline.runs_alongside:
            f = eager_factors(FACTORS)
            lapped, aside = step_seconds(timeline, spec, f, node, per, _graph_seconds)
            lapped_low, _ = step_seconds(timeline, spec, f, node, low, _graph_seconds,
                                         scale=1 / (1 + w))
            lapped, lapped_low = min(lapped, est), min(lapped_low, band[0])
        # compile_s: the part of host_s spent compiling graphs (a first step that compiles
        # for minutes is not a slow step), so the report charts the two apart.
        out = {"step": self.steps.total, "host_s": now - self._mark,
               "compile_s": min(now - self._mark, max(0.0, compiled - self._compile_mark)),
               "estimated_s": est, "band_s": band,
               # of the same ops: collectives that run alongside compute overlapped with it
               "overlapped_s": lapped, "overlapped_band_s": [lapped_low, band[1]],
               "comm_alongside_s": aside,
               "eager_s": eager, "graph_s": graphs,
               "eager_ops": int(sum(tally.ops.values())), "eager_launches": int(n),
               "launch_s": n * per,
               "compiled_s": fused + graphs,
               "compiled_band_s": [(fused + graphs) / (1 + w), (fused + graphs) * (1 + w)],
               "graph_calls": int(sum(self._step_calls.values())),
               # of estimated_s: eager collectives (latency + bytes over their link)
               "comm_s": comm_s, "tokens": tokens, "token_sharers": sharers,
               "tensor_flops": tally.tensor_flops + sum(
                   float(_estimate(g).get("tensor_flops", 0))
                   * k for g, k in self._step_calls.items())}
        self._step_calls = {}
        self._mark, self._compile_mark = now, compiled
        return out

    def not_estimated(self) -> list[str]:
        """Why parts of the run have no estimate (the counter's own failures, higher-order
        operators it ran without their cost, failed steps)."""
        out = list(self.errors)
        if self.counter.error:
            out.append(f"eager ops: {self.counter.error}")
        if self.counter.uncounted:
            out.append("eager ops: higher-order operators run without their cost: "
                       + ", ".join(sorted(self.counter.uncounted)))
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the run report: steps, graph calls, and the summary with cost."""
        from neuronlocal.estimate import BAND, FACTORS, HELD_OUT_MEDIAN_ERROR, band_width, emulated
        from neuronlocal.estimate.rates import PRICES_DATE, price
        from neuronlocal.estimate.roofline import eager_launch

        spec = emulated()
        graphs = [{"graph_id": g, "graph": _graphs.get(g, {}).get("name", str(g)),
                   "calls": int(n), "host_s_per_call": h / n if n else 0.0,
                   "estimated_s_per_call": _graph_seconds(g),
                   "calibrated": bool(_estimate(g).get("calibrated", False)),
                   "not_estimated": _estimate(g).get("not_estimated")}
                  for g, (n, h) in sorted(self.calls.items())]
        out: dict[str, Any] = {"instance": spec.name, "lnc": spec.lnc, "band": BAND,
                               "step_band": band_width("train"),
                               "held_out_median_error": HELD_OUT_MEDIAN_ERROR,
                               "steps": self.steps.kept(), "graphs": graphs, "summary": None,
                               "not_estimated": self.not_estimated()}
        if self.steps.total:
            kept = self.steps.kept()
            mid = sorted(kept, key=lambda s: s["estimated_s"])[(len(kept) - 1) // 2]
            est = mid["estimated_s"]
            host = statistics.median(s["host_s"] - s["compile_s"] for s in kept)
            p = price(spec.name)
            per, low, high = eager_launch(FACTORS)
            summary = {"steps": self.steps.total, "steps_kept": len(kept),
                       "steps_summarised": self.steps.total - len(kept),
                       "totals": dict(self.steps.sums), "estimated_step_s": est,
                       "band_s": list(mid["band_s"]), "host_step_s": host,
                       "eager_launches": mid["eager_launches"],
                       "compiled_step_s": mid["compiled_s"],
                       "compiled_band_s": list(mid["compiled_band_s"]),
                       "launch_s": [per, low, high],
                       "usd_per_hour": p.usd_per_hour if p else None,
                       "price_verified": p.verified if p else None, "price_date": PRICES_DATE}
            if p is not None:
                summary["usd_per_1000_steps"] = [p.usd_per_hour / 3.6 * x
                                                 for x in (est, *mid["band_s"])]
            out["summary"] = summary
        return out


def start() -> Capture:
    """Starts a capture (stopping a leftover one first); `Collector.start` calls this."""
    if _active is not None:
        _active.stop()
    return Capture().start()


@contextmanager
def capturing() -> Iterator[Capture]:
    cap = start()
    try:
        yield cap
    finally:
        cap.stop()
