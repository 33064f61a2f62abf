"""Dry run: this process's switch, the values it assumed, the model state it saw.

In a dry run (NEURONLOCAL_DRY_RUN=1, set by `neuronlocal run --dry-run`) neuron tensors
carry sizes, dtypes, strides and HBM accounting but no bytes (csrc/memory.cpp), and eager
ops run meta kernels (csrc/fallback.cpp). A value the program reads from the device
(`.item()`, copies to the host, ops without a meta kernel) is read from memory no kernel
wrote: zero, except the bytes of small copies from the host (csrc/kernels.cpp). Each such
read is recorded here with the user's line, for the report, and so is the first request
that would have run out of HBM (the dry run goes on past it, to the true peak). The program
is stopped after NEURONLOCAL_DRY_RUN_STEPS optimizer steps, and at each step the bytes of
the optimizer's parameters, gradients and state are measured, for the memory breakdown.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

from neuronlocal.core.config import ConfigError, env_flag, env_str

_lock = threading.Lock()
_reads: Counter[tuple[str, str]] = Counter()
_steps = 0
_model_state: dict[str, int] = {"parameters": 0, "gradients": 0, "optimizer": 0}
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


def _user_line() -> str:
    """The innermost frame outside torch and neuronlocal: where the program asked."""
    import torch

    skip = (*_SKIP, os.path.dirname(torch.__file__), os.path.dirname(os.__file__))
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    if threading.current_thread() is not threading.main_thread():
        return "backward (autograd thread: no user line)"
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


def _measure(optimizer: Any) -> None:
    """Parameters, gradients and optimizer state as the step ends (bytes on this rank)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values()
             if hasattr(v, "untyped_storage")]
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


def _after_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    global _steps
    _measure(optimizer)
    _steps += 1
    limit = step_limit()
    if limit and _steps >= limit:
        raise SystemExit(0)


def install() -> None:
    """Called once at import when this process is a dry run: the read hook, the step hook."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from neuronlocal import _C

    _C._set_dry_run(True)
    _C._set_dry_read_hook(record_read)
    register_optimizer_step_post_hook(_after_step)
