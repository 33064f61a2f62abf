"""Collectives overlapped with compute in an eager step: which run alongside, and for how long.

The serial estimate of a step adds every collective to compute. On the hardware some run
beside it: FSDP issues its all-gathers (one layer ahead: prefetching) and its
reduce-scatters (of the layers whose backward is done) on streams of their own, and DDP
issues each gradient bucket's all-reduce asynchronously during the backward. Tensor
parallelism's collectives (DTensor's redistributions, functional collectives) are waited
for where they are issued: the next op needs their result.

`Timeline` keeps a step's costs in issue order, cut at every collective, and `schedule`
plays them on two resources: the compute stream (eager ops, their launches, compiled
graphs) and one link that carries every collective, one after another. A collective that
runs alongside starts when it is issued and the link is free; the compute stream waits for
an all-gather when the next one is issued (so each layer takes the longer of its compute
and its gather), and for reductions at the optimizer step (whose hook cuts a barrier) or
the step's end. Any other collective waits for the link and holds the compute stream
until it is done. Each event starts no later than in the serial sum, so the overlapped
figure never exceeds the serial one, and equals it when nothing runs alongside.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from neuronlocal.estimate.counting import OpCost, Tally, _tensors
from neuronlocal.estimate.rates import InstanceSpec
from neuronlocal.estimate.roofline import Compiled, Factors

GATHER = "gather"  # runs alongside; its result (weights) is needed by the next layer
REDUCE = "reduce"  # runs alongside; its result (gradients) is needed by the optimizer
BARRIER = "barrier"  # the compute stream waits for every collective (optimizer step, end)
_FSDP = os.path.join("torch", "distributed", "fsdp", "")
_STACK_DEPTH = 64  # frames searched for FSDP's code above a collective


def alongside(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """GATHER or REDUCE for a collective that runs beside compute: a process-group (c10d)
    call issued by FSDP, with async_op=True (DDP's buckets), or on a stream other than the
    default one; None for one the compute stream waits for where it is issued (functional
    collectives, as DTensor and tensor parallelism issue them; synchronous calls)."""
    if func.namespace != "c10d":
        return None
    if not (_async(func, args, kwargs) or _from_fsdp() or _side_stream(args, kwargs)):
        return None
    name = func.overloadpacket.__name__
    return GATHER if "gather" in name or "broadcast" in name else REDUCE


def _async(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "async_op":
            return bool(args[i] if i < len(args) else kwargs.get(a.name, True))
    return False


def _from_fsdp() -> bool:
    """Whether FSDP's code (either version) issued the collective dispatched now. FSDP2 calls
    with async_op=False on streams of its own, which under TorchNeuron's default
    single-stream mode are the default stream: its frames say who issued it."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        if _FSDP in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _side_stream(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for t in _tensors((args, kwargs)):
        if t.device.type == "neuron":
            return torch.accelerator.current_stream(t.device.index).stream_id != 0
    return False


@dataclass
class Event:
    """What was issued since the previous event, then a collective (or a barrier)."""

    compute: Tally  # eager ops, with their counts
    graphs: list[int]  # compiled graphs called (graph ids)
    comm: OpCost | None  # the collective; None for a barrier
    times: float
    kind: str | None  # GATHER, REDUCE, BARRIER, or None (waited for where issued)


class Timeline:
    """A step's costs in issue order, cut at each collective (`Counter.timeline`)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._tally = Tally()
        self._graphs: list[int] = []
        self.runs_alongside = False  # whether any collective of the step ran alongside

    @staticmethod
    def alongside(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """`alongside`, for the counter; a failure to tell leaves the collective serial (the
        counter would otherwise drop its cost)."""
        try:
            return alongside(func, args, kwargs)
        except Exception:  # noqa: BLE001 - the observer never changes the outcome
            return None

    def add(self, cost: OpCost, times: float, kind: str | None) -> None:
        if cost.engine != "comm":
            self._tally.add(cost, times)
            return
        self.runs_alongside = self.runs_alongside or kind is not None
        self._cut(cost, times, kind)

    def graph(self, graph_id: int) -> None:
        self._graphs.append(graph_id)

    def barrier(self) -> None:
        """The compute stream waits for every collective (the optimizer step begins)."""
        self._cut(None, 0.0, BARRIER)

    def _cut(self, comm: OpCost | None, times: float, kind: str | None) -> None:
        self.events.append(Event(self._tally, self._graphs, comm, times, kind))
        self._tally, self._graphs = Tally(), []

    def closed(self) -> list[Event]:
        """The events, with what was issued after the last one and a final barrier."""
        return [*self.events, Event(self._tally, self._graphs, None, 0.0, BARRIER)]


def schedule(items: Iterable[tuple[float, float, str | None]]) -> float:
    """Seconds of a step from (compute seconds issued before, collective seconds, kind) in
    issue order, on a compute stream and one link (the model in this module's docstring)."""
    compute = link = gathered = 0.0
    for before, comm, kind in items:
        compute += before
        if kind == BARRIER:
            compute = max(compute, link)
        elif kind is None:
            compute = link = max(compute, link) + comm
        else:
            if kind == GATHER:  # the previous gather's layer begins: its weights are needed
                compute = max(compute, gathered)
            link = max(compute, link) + comm
            if kind == GATHER:
                gathered = link
    return max(compute, link)


def step_seconds(timeline: Timeline, spec: InstanceSpec, f: Factors, ranks_per_node: int | None,
                 per_launch: float, graph_seconds: Callable[[int], float],
                 scale: float = 1.0) -> tuple[float, float]:
    """(overlapped seconds of the step, seconds of its collectives that ran alongside), with
    each op priced as the serial estimate prices it (`scale` times the roofline and graphs,
    `per_launch` seconds per eager op: the band's ends)."""
    events = timeline.closed()
    union = Tally()
    for e in events:
        for op in e.compute.ops:
            union.ops[op] = 1.0
        if e.comm is not None:
            union.ops[e.comm] = 1.0
    price = dict(zip(union.ops, Compiled(union, spec, ranks_per_node).per_call(f).tolist(),
                     strict=True)) if union.ops else {}
    items, aside = [], 0.0
    for e in events:
        roof = sum(price[op] * n for op, n in e.compute.ops.items())
        launches = sum(e.compute.ops.values())  # every costed compute op is one launch
        before = scale * (roof + sum(graph_seconds(g) for g in e.graphs)) + launches * per_launch
        comm = scale * price[e.comm] * e.times if e.comm is not None else 0.0
        if e.kind in (GATHER, REDUCE):
            aside += comm
        items.append((before, comm, e.kind))
    return schedule(items), aside
