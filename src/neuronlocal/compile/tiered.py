"""The tiered compiler (NEURONLOCAL_COMPILER=tiered): op by op at once, Inductor's code when hot.

A graph (one concrete shape) compiles at its first call with the default compiler (tier 1:
AOTAutograd's graphs run op by op through the neuron eager path, a compile of seconds). At
its second call, a graph that keeps being called is queued for stock Inductor in a
background process (compile/worker.py), which writes the compiled code to the persistent
compile cache. At call NEURONLOCAL_TIER_SWITCH the graph switches to tier 2: the same
Inductor path as NEURONLOCAL_COMPILER=inductor, which now loads from that cache. If the
background compile is not done by then, the call waits for it, so which calls run which
tier depends on call counts only, never on timing. A background compile that fails (or a
graph that cannot be sent to it) leaves the graph in tier 1 with one log line.

Both tiers keep every Trainium rule: one record per graph (its tier and switch on the
record's `extra`), placement, fallback tracking, the 64-bit rule, HBM accounting (tier 2's
intermediates are CPU memory of Inductor's code, as with NEURONLOCAL_COMPILER=inductor).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from neuronlocal.compile import worker
from neuronlocal.compile.static import _CACHE, compile_eager, inductor_graph, inductor_job
from neuronlocal.core import dynamo_metrics as metrics
from neuronlocal.core.config import env_calls
from neuronlocal.estimate import capture as estimate_capture

log = logging.getLogger("neuronlocal.compile")
QUEUE_AT = 2  # the call that queues the background compile: the graph was called again


def _input_specs(examples: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What the background compiler needs of each example input: a tensor's layout, dtype and
    requires_grad (it compiles on empty tensors of that layout), or the value itself."""
    out: list[tuple[Any, ...]] = []
    for x in examples:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."),
                        x.requires_grad, None))
        else:
            out.append((None, None, None, None, x))
    return out


def _tensor_attributes(gm: fx.GraphModule) -> bool:
    """Whether the graph (or a body of one of its higher-order ops) holds a tensor."""
    return any(isinstance(v, torch.Tensor) for m in gm.modules() for v in vars(m).values()) or \
        any(True for m in gm.modules() for _ in m.parameters(recurse=False)) or \
        any(True for m in gm.modules() for _ in m.buffers(recurse=False))


class TieredGraph:
    """One static graph under the tiered compiler: tier 1 from its first call, tier 2 from
    call `switch` (0: never)."""

    def __init__(self, gm: fx.GraphModule, args: Sequence[Any], options: dict[str, Any],
                 kind: str, extra: dict[str, Any]) -> None:
        self.gm, self.options = gm, options
        before = metrics.next_graph_id()
        self.fn: Callable[..., Any] = compile_eager(gm, args, options, kind, extra)
        self.record = metrics.last_record() if metrics.next_graph_id() > before else None
        self.switch = env_calls("NEURONLOCAL_TIER_SWITCH") if self.record is not None else 0
        self.calls = 0
        self.job: worker.Job | None = None
        self.sent: bytes | None = None  # the pickled CPU graph the background compiler got
        self._tier({"tier": "eager", "tier_switch_at": self.switch or None})

    def _tier(self, facts: dict[str, Any]) -> None:
        if self.record is not None:
            self.record.extra.update(facts)

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.switch:
            if self.calls == QUEUE_AT and self.switch > QUEUE_AT:
                self._queue(args)
            if self.calls == self.switch:
                with _disable_current_modes():  # as the first compile (compile/backend.py)
                    self._switch(args)
        return self.fn(*args)

    def _queue(self, args: Sequence[Any]) -> None:
        """Hands the graph to the background compiler, when a cache can carry its result."""
        if _CACHE.state().mode != "rw":
            return  # no writable cache: the switch compiles in the foreground
        assert self.record is not None
        with _disable_current_modes():
            job = inductor_job(self.gm, args, self.options)
        try:
            self.sent = pickle.dumps(job.cpu_gm, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - some graphs cannot travel: they stay in tier 1
            log.warning("neuron: %s stays in the first tier: it cannot be sent to the "
                        "background compiler (%s: %s)", self.record.graph_name,
                        type(e).__name__, str(e)[:200])
            self._tier({"tier_error": f"not picklable: {type(e).__name__}: {e}"[:300]})
            self.switch = 0
            return
        self.job = worker.submit(self.record.graph_name, {
            "key": job.key, "name": self.record.graph_name, "gm": self.sent,
            "patches": job.patches, "grad": job.grad, "inputs": _input_specs(job.examples)})

    def _switch(self, args: Sequence[Any]) -> None:
        assert self.record is not None
        name = self.record.graph_name
        start = time.perf_counter()
        if self.job is not None and not self.job.wait():
            self._tier({"tier_error": self.job.error[-300:]})
            return  # the worker logged why; the graph stays in tier 1
        waited = time.perf_counter() - start
        try:
            job = inductor_job(self.gm, args, self.options)
            if self.sent is not None and not _tensor_attributes(job.cpu_gm):
                # The very graph the child compiled (rebuilt from the same pickled code), so
                # AOTAutograd's cache key is the child's too and its entry is a hit. Graphs
                # with tensor attributes keep the fresh copy: its attributes alias the
                # device tensors, the pickled ones are copies.
                job.cpu_gm = pickle.loads(self.sent)  # noqa: S301 - our own bytes
            compiled, cache = inductor_graph(self.gm, args, name, job)
        except Exception as e:  # noqa: BLE001 - a failed switch never fails the step
            log.warning("neuron: %s stays in the first tier: Inductor failed (%s: %s)", name,
                        type(e).__name__, str(e)[:300])
            self._tier({"tier_error": f"{type(e).__name__}: {e}"[:300]})
            return
        self.fn = estimate_capture.counted(self.record, compiled)
        bg = self.job
        self._tier({"tier": "inductor", "tier_switched_at": self.calls,
                    "tier_wait_s": round(waited, 3),
                    "tier_load_s": round(time.perf_counter() - start - waited, 3),
                    "tier_cache": cache,
                    "tier_background_s": round(bg.seconds, 3) if bg else None,
                    "tier_worker_peak_rss_bytes": bg.peak_rss_bytes if bg else None})
        log.info("neuron: %s switched to Inductor's code at call %d (waited %.1f s)", name,
                 self.calls, waited)
