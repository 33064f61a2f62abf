"""The `neuron` c10d backend: gloo collectives on zero-copy CPU aliases of neuron tensors.

TorchNeuron registers a process-group backend named `neuron` (spec section 4). Device memory
is host memory here, so each collective hands gloo the CPU alias of every neuron tensor
(same bytes, `neuronlocal._C._cpu_alias`) and gloo writes its result straight into the
neuron tensor: no staging copies. The same job therefore runs past one machine on
torchrun + gloo over TCP.

The group is a Python `dist.ProcessGroup` (the route PyTorch's own Python backends take):
C++ callers (DDP's reducer, functional collectives) reach the overridden methods through
PyTorch's trampoline. An inner `ProcessGroupGloo` does the work; it is also registered as
the group's CPU backend, so the C++ paths the trampoline does not override
(`_allgather_base`, `_reduce_scatter_base` from functional collectives inside compiled
graphs, which see CPU aliases) still reach gloo. Neuron tensors on those paths are routed
by `neuronlocal.distributed.functional`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch.distributed import ProcessGroup

from neuronlocal import _C
from neuronlocal.report.metrics import record_collective

BACKEND = "neuron"


class NeuronCollectiveError(RuntimeError):
    """A collective of the `neuron` backend failed (peer died, timeout, mismatched inputs)."""


def _alias(t: torch.Tensor) -> torch.Tensor:
    return _C._cpu_alias(t) if t.device.type == "neuron" else t


def _stacked(big: torch.Tensor, small: torch.Tensor, size: int) -> torch.Tensor:
    """`big` (an alias) shaped as `size` copies of `small` stacked on dim 0.

    NCCL only checks element counts for all_gather_into_tensor / reduce_scatter_tensor, and
    callers such as accelerate's gather rely on it; gloo wants dim-0 chunks shaped like the
    input, so a contiguous flat buffer is viewed in that shape (no copy).
    """
    alias = _alias(big)
    if not alias.is_contiguous():
        return alias
    shape = (size * small.shape[0], *small.shape[1:]) if small.dim() else (size,)
    return alias.view(shape)


def _aliases(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_C._cpu_alias(t) if t.device.type == "neuron" else t for t in ts]


def _has_neuron(ts: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in ts)


class NeuronWork(dist.Work):
    """Wraps gloo's Work: waits with a clear error, and futures yield the neuron tensors."""

    def __init__(self, inner: dist.Work, result: list[torch.Tensor], what: str,
                 pg: NeuronProcessGroup) -> None:
        super().__init__()
        self._inner = inner
        self._result = result
        self._what = what
        self._pg = pg

    def _error(self, exc: BaseException) -> NeuronCollectiveError:
        return NeuronCollectiveError(
            f"neuron backend: {self._what} failed on rank {self._pg.rank()} of "
            f"{self._pg.size()} (timeout {self._pg.timeout}). A peer rank may have died or "
            "stopped calling collectives, or the ranks passed tensors of different shapes or "
            "dtypes (run with NEURONLOCAL_DIST_CHECKS=1 to have that checked before every "
            f"collective). gloo said: {exc}")

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            return self._inner.wait(timeout) if timeout else self._inner.wait()
        except RuntimeError as exc:
            raise self._error(exc) from exc

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        result = self._result

        def done(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.value()  # re-raises gloo's error
            return result

        return self._inner.get_future().then(done)


class NeuronProcessGroup(ProcessGroup):
    """Process group of backend `neuron`: every collective runs on gloo over CPU aliases."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.timeout = timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # C++ paths the trampoline does not override dispatch by device: CPU -> gloo.
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        from neuronlocal.distributed import checks
        self._checker = checks.Checker(self) if checks.enabled() else None
        self._coalesced: list[dist.Work] | None = None

    # --- identity -------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802  (c10d's name)
        return BACKEND

    def _wrap(self, work: dist.Work, result: list[torch.Tensor], what: str) -> dist.Work:
        # The run report counts collectives per rank: bytes are this rank's result tensors.
        record_collective(what, sum(t.numel() * t.element_size() for t in result), self.rank())
        wrapped = NeuronWork(work, result, what, self)
        if self._coalesced is not None:
            self._coalesced.append(wrapped)
        return wrapped

    # gloo issues each op at once; a coalescing block returns one Work over all of them.
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        works, self._coalesced = self._coalesced or [], None
        return _AllOf(works)

    def _check(self, what: str, tensors: Any, root: int | None = None) -> None:
        if self._checker is not None:
            self._checker.check(what, tensors, root)

    # --- all-reduce -----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        if not isinstance(opts, dist.AllreduceOptions):  # pg.allreduce(t, op=...) style
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        self._check("all_reduce", tensors)
        return self._wrap(self._gloo.allreduce(_aliases(tensors), opts), tensors, "all_reduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        self._check("all_reduce_coalesced", tensors)
        # gloo's allreduce handles a list of tensors as one coalesced operation.
        ar = dist.AllreduceOptions()
        ar.reduceOp = opts.reduceOp
        ar.timeout = opts.timeout
        works = [self._gloo.allreduce([a], ar) for a in _aliases(tensors)]
        return self._wrap(_AllOf(works), tensors, "all_reduce_coalesced")

    # --- all-gather -----------------------------------------------------------------------
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        self._check("all_gather", inputs)
        work = self._gloo.allgather([_aliases(o) for o in outputs], _aliases(inputs), opts)
        return self._wrap(work, [t for o in outputs for t in o], "all_gather")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        self._check("all_gather_into_tensor", [input])
        _even(output, input, self.size(), "all_gather_into_tensor", gather=True)
        work = self._gloo._allgather_base(_stacked(output, input, self.size()), _alias(input),
                                          opts)
        return self._wrap(work, [output], "all_gather_into_tensor")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        self._check("all_gather_into_tensor_coalesced", inputs)
        works = [self._gloo._allgather_base(_alias(o), _alias(i), opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._wrap(_AllOf(works), list(outputs), "all_gather_into_tensor_coalesced")

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        self._check("all_gather_coalesced", inputs)
        work = self._gloo.allgather_coalesced([_aliases(o) for o in outputs], _aliases(inputs),
                                              opts)
        return self._wrap(work, [t for o in outputs for t in o], "all_gather_coalesced")

    # --- reduce-scatter -------------------------------------------------------------------
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._check("reduce_scatter", outputs)
        work = self._gloo.reduce_scatter(_aliases(outputs), [_aliases(i) for i in inputs], opts)
        return self._wrap(work, list(outputs), "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._check("reduce_scatter_tensor", [input])
        _even(input, output, self.size(), "reduce_scatter_tensor", gather=False)
        work = self._gloo._reduce_scatter_base(_alias(output),
                                               _stacked(input, output, self.size()), opts)
        return self._wrap(work, [output], "reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._check("reduce_scatter_tensor_coalesced", inputs)
        works = [self._gloo._reduce_scatter_base(_alias(o), _alias(i), opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._wrap(_AllOf(works), list(outputs), "reduce_scatter_tensor_coalesced")

    # --- rooted collectives ---------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        if isinstance(tensors, torch.Tensor):  # pg.broadcast(t, root) style
            root, opts = opts if isinstance(opts, int) else 0, dist.BroadcastOptions()
            opts.rootRank, tensors = root, [tensors]
        self._check("broadcast", tensors, root=opts.rootRank)
        return self._wrap(self._gloo.broadcast(_aliases(tensors), opts), tensors, "broadcast")

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        self._check("reduce", tensors, root=opts.rootRank)
        return self._wrap(self._gloo.reduce(_aliases(tensors), opts), tensors, "reduce")

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.GatherOptions()
        self._check("gather", inputs, root=opts.rootRank)
        work = self._gloo.gather([_aliases(o) for o in outputs], _aliases(inputs), opts)
        return self._wrap(work, [t for o in outputs for t in o], "gather")

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        self._check("scatter", outputs, root=opts.rootRank)
        work = self._gloo.scatter(_aliases(outputs), [_aliases(i) for i in inputs], opts)
        return self._wrap(work, list(outputs), "scatter")

    # --- all-to-all (even splits only, as TorchNeuron) ------------------------------------
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        _even_splits(output, input, output_split_sizes, input_split_sizes, self.size())
        self._check("all_to_all_single", [input])
        work = self._gloo.alltoall_base(_alias(output), _alias(input), [], [], opts)
        return self._wrap(work, [output], "all_to_all_single")

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        shapes = {tuple(t.shape) for t in [*outputs, *inputs]}
        if len(shapes) != 1:
            raise ValueError(
                "neuron backend: all_to_all supports only even splits (as TorchNeuron): every "
                f"input and output tensor must have one shape, got {sorted(shapes)}. Pad the "
                "chunks to one size.")
        self._check("all_to_all", inputs)
        # One flat exchange; the list API is rare, so a pack/unpack copy is acceptable here.
        flat_in = torch.cat([_alias(t).reshape(-1) for t in inputs])
        flat_out = torch.empty_like(flat_in)
        self._gloo.alltoall_base(flat_out, flat_in, [], [], opts).wait()
        for o, chunk in zip(outputs, flat_out.chunk(len(outputs)), strict=True):
            _alias(o).copy_(chunk.view(o.shape))
        return self._wrap(_Done(), list(outputs), "all_to_all")

    # --- point to point and barrier -------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._wrap(self._gloo.send(_aliases(tensors), dst, tag), tensors, "send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._wrap(self._gloo.recv(_aliases(tensors), src, tag), tensors, "recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._wrap(self._gloo.recv_anysource(_aliases(tensors), tag), tensors, "recv")

    def barrier(self, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._wrap(self._gloo.barrier(opts), [], "barrier")

    # torch 2.13 Python names (distributed_c10d and the C++ trampoline look these up)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        self._gloo.monitored_barrier(timeout or self.timeout, wait_all_ranks)


class _AllOf(dist.Work):
    """Several gloo works seen as one (coalesced calls)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for w in self._works:
            w.wait(timeout) if timeout else w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Any:
        return None

    def source_rank(self) -> int:
        return -1

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])


class _Done(_AllOf):
    """An already finished work (collectives run synchronously)."""

    def __init__(self) -> None:
        super().__init__([])

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([])
        return fut


def _even(big: torch.Tensor, small: torch.Tensor, size: int, what: str, gather: bool) -> None:
    if big.numel() != small.numel() * size:
        names = ("output", "input") if gather else ("input", "output")
        raise ValueError(
            f"neuron backend: {what} needs {names[0]}.numel() == world_size * "
            f"{names[1]}.numel(), got {big.numel()} and {small.numel()} with world size "
            f"{size}. Size the {names[0]} as world_size x {names[1]}.")
    if big.dtype != small.dtype:
        raise TypeError(f"neuron backend: {what} needs one dtype for input and output, got "
                        f"{small.dtype if gather else big.dtype} and "
                        f"{big.dtype if gather else small.dtype}. Cast one of them.")


def _even_splits(output: torch.Tensor, input: torch.Tensor, out_splits: Sequence[int],
                 in_splits: Sequence[int], size: int) -> None:
    """TorchNeuron's alltoall_base supports only even splits; say so instead of computing."""
    for name, t, splits in (("input", input, in_splits), ("output", output, out_splits)):
        rows = t.shape[0] if t.dim() else 0
        if splits:
            if len(set(splits)) != 1 or len(splits) != size:
                raise NotImplementedError(
                    "neuron backend: all_to_all_single supports only even splits (a "
                    f"TorchNeuron limitation, spec section 4), got {name}_split_sizes="
                    f"{list(splits)} for world size {size}. Pad every chunk to "
                    f"{max(splits) if splits else 0} rows and pass equal splits (or None).")
        elif rows % size:
            raise ValueError(
                f"neuron backend: all_to_all_single with no split sizes needs {name}.shape[0] "
                f"({rows}) divisible by the world size ({size}).")


def make_creator(bind: Callable[[], None]) -> Callable[..., ProcessGroup]:
    """The function `dist.Backend.register_backend` calls for every new `neuron` group."""

    def create(common: Any, _options: Any = None) -> ProcessGroup:
        bind()  # idempotent: the first group of the job binds the rank to its core
        return NeuronProcessGroup(common.store, common.group_rank, common.group_size,
                                  common.timeout)

    return create
