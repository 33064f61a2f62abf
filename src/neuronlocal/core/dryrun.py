"""Dry run: this process's switch, the values it assumed, the model state it saw.

In a dry run (NEURONLOCAL_DRY_RUN=1, set by `neuronlocal run --dry-run`) neuron tensors
carry sizes, dtypes, strides and HBM accounting but no bytes (csrc/dry_memory.cpp), and eager
ops run meta kernels (csrc/fallback.cpp). A value the program reads from the device
(`.item()`, copies to the host, ops without a meta kernel) is read from memory no kernel
wrote: zero, except the bytes of small copies from the host (csrc/kernels.cpp). Each such
read is recorded here with the user's line, for the report, and so is the first request
that would have run out of HBM (the dry run goes on past it, to the true peak). The program
is stopped after NEURONLOCAL_DRY_RUN_STEPS optimizer steps, and at each step the bytes of
the optimizer's parameters, gradients and state are measured (the model state).

The peak's breakdown: storages are tagged with what they hold (parameters, gradients and
optimizer state at each step and from the live nn.Parameters at the end, tensors autograd
saves for backward through a default saved-tensors hook, collective results in the C++
process group); the allocator keeps the live blocks at its high-water mark with their tags,
so the bytes of each kind at the peak add up to the peak exactly. Untagged: temporaries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from types import FrameType
from typing import Any

from neuronlocal.core.config import ConfigError, env_flag, env_str, parse_routing
from neuronlocal.core.steps import OuterSteps

_lock = threading.Lock()
_reads: Counter[tuple[str, str]] = Counter()
_steps = 0
_model_state: dict[str, int] = {"parameters": 0, "gradients": 0, "optimizer": 0}
# The allocator's tags (csrc neuron.h PeakTag: a lower one wins); untagged is "temporaries".
TAGS = {"parameters": 1, "gradients": 2, "optimizer": 3, "collectives": 4, "activations": 5}
BREAKDOWN = (*TAGS, "temporaries")
_warned = False
log = logging.getLogger("neuronlocal")
_SKIP = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)


def enabled() -> bool:
    """Whether this process is a dry run (read now). A bad value is not one: it is the
    configuration error the device raises at its first use (config.py), never an import
    error."""
    try:
        return env_flag("NEURONLOCAL_DRY_RUN")
    except ConfigError:
        return False


def step_limit() -> int:
    """NEURONLOCAL_DRY_RUN_STEPS; a value that is not a whole number is warned once and
    means no limit (an import must never fail on it)."""
    global _warned
    raw = env_str("NEURONLOCAL_DRY_RUN_STEPS")
    if raw is None:
        return 0
    if raw.isdigit():
        return int(raw)
    if not _warned:
        _warned = True
        log.warning("NEURONLOCAL_DRY_RUN_STEPS=%r is not a whole number of steps; the dry "
                    "run goes to the program's end. Use e.g. 2 (0: no limit).", raw)
    return 0


def routing() -> float:
    """NEURONLOCAL_DRY_RUN_ROUTING: -1 balanced, else the fraction of rows on index 0. A bad
    value is balanced here; the device then refuses to start with the configuration error
    (config.py), so no run reports numbers under a policy it was not given."""
    raw = env_str("NEURONLOCAL_DRY_RUN_ROUTING")
    try:
        return parse_routing("NEURONLOCAL_DRY_RUN_ROUTING", raw) if raw else -1.0
    except ConfigError:
        return -1.0


def _user_line() -> str:
    """The innermost frame outside torch and neuronlocal: where the program asked. On
    autograd's thread, the backward node that ran (its forward line is not kept)."""
    import torch

    skip = (*_SKIP, os.path.dirname(torch.__file__), os.path.dirname(os.__file__))
    f: FrameType | None = sys._getframe(0)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    if threading.current_thread() is not threading.main_thread():
        node = torch._C._current_autograd_node()
        what = f"backward, {node.name()}" if node is not None else "backward"
        return f"{what} (autograd thread: no user line)"
    return "?"


def record_read(what: str) -> None:
    """The C++ core read a value a dry run does not have (it used zeros)."""
    where = _user_line()
    with _lock:
        _reads[(what, where)] += 1


def reads() -> list[dict[str, Any]]:
    """[{op, at, count}]: every place a value was assumed (zero), most frequent first."""
    with _lock:
        items = _reads.most_common()
    return [{"op": op, "at": at, "count": n} for (op, at), n in items]


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct neuron storages behind `tensors` (a DTensor: its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if t is None or getattr(t, "device", None) is None or t.device.type != "neuron":
            continue
        st = t.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def _tag(tensors: list[Any], what: str) -> None:
    """Marks the neuron storages of `tensors` (a DTensor: its local shard) as `what`."""
    from neuronlocal import _C

    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if t is not None and getattr(t, "device", None) is not None and \
                t.device.type == "neuron":
            _C._tag_storage(t, TAGS[what])


def _pack(t: Any) -> Any:
    """The saved-tensors hook: tags what autograd saves for backward, keeps it as is. Fake
    tensors of a compile's tracing have no storage of ours: left alone."""
    x = getattr(t, "_local_tensor", t)
    if type(x) in _PLAIN and x.device.type == "neuron":
        from neuronlocal import _C

        _C._tag_storage(x, TAGS["activations"])
    return t


def _unpack(t: Any) -> Any:
    return t


_PLAIN: tuple[type, ...] = ()


def _stepping_aside(original: Any) -> Any:
    """`torch.autograd.graph.disable_saved_tensors_hooks` that first pops this module's
    hook when it is the innermost one: torch.func transforms refuse any saved-tensors hook,
    so while one runs, what it saves goes untagged (temporaries) instead of failing."""
    import torch

    @contextlib.contextmanager
    def disable(error_message: str) -> Iterator[None]:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        ours = top is not None and top[0] is _pack
        if ours:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        try:
            with original(error_message):
                yield
        finally:
            if ours:
                torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)

    return disable


# The modules a parameter was registered on (a WeakSet: the dry run keeps none alive), and
# the storage each parameter was last tagged at: a parameter moved to the device gets new
# storage. What a module holds now counts (FSDP2 swaps its unsharded weights in without
# registering them). Parameters themselves are never weakly referenced: `Module.to_empty`
# and `.to` swap a tensor subclass parameter (a DTensor of tensor parallelism) in place with
# `torch.utils.swap_tensors`, which refuses a tensor that has a weak reference.
_modules: weakref.WeakSet[Any] = weakref.WeakSet()
_tagged: dict[int, int] = {}


def _registered(module: Any, _name: str, _param: Any) -> None:
    _modules.add(module)


def _tag_live_parameters() -> None:
    """Tags the storages of the parameters the registering modules hold now that are new
    since the last call (a script without an optimizer has weights too). Called when an op
    call sets a new peak, while the peak's blocks are still live."""
    from neuronlocal import _C

    for p in [p for m in list(_modules) for p in m._parameters.values() if p is not None]:
        t = getattr(p, "_local_tensor", p)
        if t.device.type != "neuron":
            continue
        ptr = t.untyped_storage().data_ptr()
        if _tagged.get(id(p)) != ptr:
            _tagged[id(p)] = ptr
            _C._tag_storage(t, TAGS["parameters"])


def _peak_line() -> str:
    """The allocator's peak hook: tags the weights, then names the user's line. It never
    raises (nor prints): it runs inside allocations, on any thread, even at shutdown."""
    try:
        _tag_live_parameters()
        return _user_line()
    except Exception:  # noqa: BLE001 - a breakdown must never break the program
        return "?"


def peak(index: int) -> dict[str, Any]:
    """The peak of core `index`: bytes, the op and user line of the allocation that set it,
    and its breakdown (bytes per kind, adding up to the peak)."""
    from neuronlocal import _C

    _tag_live_parameters()
    nbytes, op, line, by_tag = _C._peak_snapshot(index)
    names = {v: k for k, v in TAGS.items()}
    out = dict.fromkeys(BREAKDOWN, 0)
    for tag, n in by_tag.items():
        out[names.get(tag, "temporaries")] += n
    return {"bytes": nbytes, "op": op or None, "at": line or None, "breakdown": out}


def _measure(optimizer: Any) -> None:
    """Parameters, gradients and optimizer state as the step ends (bytes on this rank)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values()
             if hasattr(v, "untyped_storage")]
    _tag(params, "parameters")
    _tag([p.grad for p in params], "gradients")
    _tag(state, "optimizer")
    now = {"parameters": _storage_bytes(params),
           "gradients": _storage_bytes([p.grad for p in params]),
           "optimizer": _storage_bytes(state)}
    with _lock:
        for k, v in now.items():
            _model_state[k] = max(_model_state[k], v)


def model_state() -> dict[str, int]:
    with _lock:
        return dict(_model_state)


def steps() -> int:
    return _steps


_outer = OuterSteps()


def _before_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    _outer.begin(optimizer)


def _after_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    global _steps
    _measure(optimizer)
    if _outer.end(optimizer):  # an inner optimizer of a container is not a step of its own
        _steps += 1


def _stop_at_limit(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    limit = step_limit()
    if limit and _steps >= limit:
        raise SystemExit(0)


_limit_hook: Any = None


def arm_step_limit() -> None:
    """(Re)registers the stop after K steps behind every step hook registered so far: the
    run report's estimate closes the last step before the program is stopped."""
    global _limit_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _limit_hook is not None:
        _limit_hook.remove()
    _limit_hook = register_optimizer_step_post_hook(_stop_at_limit)


def install() -> None:
    """Called once at import when this process is a dry run: the read hook, the step hook,
    the peak's line and the saved-tensors hook of the breakdown."""
    global _PLAIN
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from neuronlocal import _C

    _PLAIN = (torch.Tensor, torch.nn.Parameter)
    _C._set_dry_run(True)
    _C._set_dry_read_hook(record_read)
    _C._set_dry_routing(routing())
    _C._set_peak_hook(_peak_line)
    torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
    torch._C._autograd._push_saved_tensors_default_hooks(_pack, _unpack)
    graph = torch.autograd.graph
    graph.disable_saved_tensors_hooks = _stepping_aside(
        graph.disable_saved_tensors_hooks)
    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    arm_step_limit()
