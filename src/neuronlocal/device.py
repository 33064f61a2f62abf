"""torch.neuron: the device module, mirroring torch.cuda and TorchNeuron's
`torch.neuron` (docs/architecture.md lists the public sources).

Registered as `torch.neuron` by `neuronlocal/__init__.py`. Device selection, streams and
events go through the C++ device guard, so `torch.accelerator`, `torch.Stream` and
autograd see the same current device. The runtime starts at the first device use (the
core count is read then, core/state.py); seeding before it is queued until it starts.
Each logical core has a generator with TorchNeuron's 16-byte (seed, offset) state
(csrc/generator.cpp). As on TorchNeuron, random ops on neuron tensors (`randn_like`,
`normal_`, dropout, ...) run on the host and draw from CPU's global generator unless a
generator is passed: `torch.manual_seed` fixes them, the stream continues across CPU and
neuron draws, and `torch.neuron.manual_seed` sets the core's state without changing what they
draw. A neuron generator passed explicitly draws CPU's stream for its seed, and so does the
core's own generator once `set_rng_state` sets its state, until it is seeded again: DTensor's
random-number tracker sets that state for each random op inside `torch.random.fork_rng`,
which restores CPU's generator afterwards, so CPU's stream would repeat in every region.

With a bad environment variable the device is unavailable, as CUDA is with a broken driver:
`is_available()` returns False (and warns once with the reason), seeding is a no-op (so
`torch.manual_seed` keeps working on CPU), and every other use, `device_count()` included,
raises the configuration error: a RuntimeError (also a ValueError) in one line naming the
variable, its value and the accepted values. That is what TorchNeuron raises from
`device_count()` without a device, and what transformers and accelerate catch when probing.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from neuronlocal import _C
from neuronlocal import amp as amp  # torch.neuron.amp, as torch.cuda.amp
from neuronlocal.core import state as _state
from neuronlocal.core.config import env_flag
from neuronlocal.memory import *  # noqa: F403  (the memory API is part of torch.neuron)
from neuronlocal.memory import Device, device_index
from neuronlocal.memory import __all__ as _memory_all

__all__ = [
    "Event", "Stream", "StreamContext", "current_device", "current_stream", "default_stream",
    "device", "device_count", "device_of", "get_amp_supported_dtype", "get_device_capability",
    "get_device_name", "get_device_properties", "get_rng_state", "get_rng_state_all", "init",
    "initial_seed", "is_available", "is_bf16_supported", "is_initialized", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "set_device", "set_rng_state", "set_rng_state_all",
    "set_stream", "stream", "synchronize", *_memory_all,
]

_warned_unavailable = False


def _is_in_bad_fork() -> bool:
    """Never: neuron memory is host memory, so a forked child (a DataLoader worker, a
    forkserver row) keeps a working device, and torch.manual_seed must seed it there too
    (torch skips seeding devices that report a bad fork)."""
    return False


def _rebuild_on_neuron(data: bytes, index: int, requires_grad: bool,
                       parameter: bool) -> torch.Tensor:
    cpu = torch.load(io.BytesIO(data), weights_only=True)
    t = cpu.to(f"neuron:{index}")
    if parameter:
        return torch.nn.Parameter(t, requires_grad)
    return t.requires_grad_(requires_grad)


def _share_through_cpu(reduce: Any) -> Any:
    """torch.multiprocessing's tensor reduction, with neuron tensors sent as the bytes of a
    CPU copy and moved back to their core on arrival. Without it a forked DataLoader worker
    that returns a neuron tensor fails in its queue thread (`_share_fd_: only available on
    CPU`) and the main process waits for that batch forever. Bytes, not shared memory: the
    CPU copy is a temporary nobody keeps, and a spawned child (Process(args=...),
    mp.spawn, a spawn DataLoader) would open its shared memory after it was freed."""

    def reduce_tensor(t: torch.Tensor) -> Any:
        if t.device.type != "neuron" or (t.requires_grad and not t.is_leaf):
            return reduce(t)  # torch's own rules (and its error for non-leaf tensors)
        buf = io.BytesIO()
        torch.save(t.detach().cpu(), buf)
        return _rebuild_on_neuron, (buf.getvalue(), t.device.index or 0, t.requires_grad,
                                    isinstance(t, torch.nn.Parameter))

    return reduce_tensor


def _install_sharing() -> None:
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    reductions.init_reductions()  # torch's own first, so ours wraps them
    for cls in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(cls, _share_through_cpu(reductions.reduce_tensor))


_install_sharing()


def check_available() -> None:
    """Raises the configuration error that makes the device unavailable, if there is one."""
    error = _state.config_error
    if error is not None:
        raise type(error)(f"neuron device unavailable: {error}") from None


def is_available() -> bool:
    """False when the configuration is bad (warned once, with the reason); never raises."""
    global _warned_unavailable
    if _state.config_error is not None:
        if not _warned_unavailable:
            _warned_unavailable = True
            warnings.warn(f"neuron device unavailable: {_state.config_error}", stacklevel=2)
        return False
    return device_count() > 0


def is_initialized() -> bool:
    """Whether the device runtime has started (at the first device use, or `init()`)."""
    return _state.started()


def init() -> None:
    """Starts the device runtime now (idempotent); raises its configuration error."""
    _state.start()
    check_available()


def device_count() -> int:
    """Number of logical NeuronCores this process sees."""
    check_available()
    return _C._device_count()


def current_device() -> int:
    return _C._current_device()


def set_device(device: Device) -> None:
    """Selects the current core; None and `neuron` (no index) keep the current one. An index
    that does not exist is a ValueError, as TorchNeuron's `set_device` raises (using such a
    device elsewhere is a RuntimeError)."""
    if isinstance(device, str):
        device = torch.device(device)
    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        index = current_device()
    n = device_count()
    if not 0 <= index < n:
        raise ValueError(f"Invalid device id: {index}. Valid range is 0 to {n - 1}")
    _C._set_device(index)


class device:
    """Context manager that changes the current core, like torch.cuda.device."""

    def __init__(self, device: Device) -> None:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            device = device_index(device) if device.index is None else device.index
        self.idx = -1 if device is None else device
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _C._current_device()
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            _C._set_device(self.prev)


class device_of(device):
    """Context manager selecting the core of a tensor (no-op for CPU tensors)."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.device.index if obj.device.type == "neuron" else None)


def get_device_name(device: torch.device | int = 0) -> str:
    """What TorchNeuron returns: `str(device)` for a torch.device, `neuron:<i>` for an int."""
    if isinstance(device, torch.device):
        return str(device)
    if isinstance(device, int):
        return f"neuron:{device}"
    raise ValueError("Incorrect device argument found, expected torch.device or int type, "
                     f"found {type(device)}")


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    core_type: str
    instance: str
    logical_nc_config: int
    physical_core_id: int

    def __repr__(self) -> str:
        return (f"_NeuronDeviceProperties(name='{self.name}', total_memory="
                f"{self.total_memory // 2**20}MB, core_type='{self.core_type}', "
                f"instance='{self.instance}', lnc={self.logical_nc_config})")


def get_device_properties(device: Device = None) -> DeviceProperties:
    """`name` is the instance family (`trn2`, `trn3`), as TorchNeuron's runtime reports it."""
    if isinstance(device, int) and not 0 <= device < device_count():
        raise ValueError(f"Invalid device id: {device}")
    i = device_index(device)
    p = _state.profile
    core = "NeuronCore-v3" if p.chip.name == "Trainium2" else "NeuronCore-v4"
    family = p.instance.split(".")[0]
    return DeviceProperties(family, p.hbm_per_core, core, p.instance, p.lnc, p.visible[i])


def get_device_capability(device: Device = None) -> tuple[int, int]:
    device_index(device)
    return (2, 0) if _state.profile.chip.name == "Trainium2" else (3, 0)


def synchronize(device: Device = None) -> None:
    """Waits for queued work: ops run on the host as they are called, except runs of foreach
    ops (optimizer steps), which are queued and fused per tensor."""
    device_index(device)
    _C._synchronize()


# ---- streams and events -------------------------------------------------------------------


class Stream(torch.Stream):
    """A neuron stream. Work runs in order on the host, so streams only order bookkeeping."""

    def __new__(cls, device: Device = None, priority: int = 0, **kwargs: Any) -> Stream:
        """A new stream of the device; in TorchNeuron's default single-stream mode (without
        NEURON_RT_ENABLE_HOST_CC=1, read at each call) that is the device's default stream."""
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        with globals()["device"](device):
            if not env_flag("NEURON_RT_ENABLE_HOST_CC"):
                return default_stream()
            return super().__new__(cls, device=f"neuron:{current_device()}", priority=priority)

    def wait_event(self, event: torch.Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: torch.Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        event = Event() if event is None else event
        event.record(self)
        return event


class _EventMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "neuron"


class Event(metaclass=_EventMeta):
    """A neuron event; `elapsed_time` measures host time between two records.

    Constructing one returns a `torch.Event` on neuron (torch.Event's methods accept only
    that exact type), and `isinstance(e, torch.neuron.Event)` holds for it.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,  # type: ignore[misc]
                interprocess: bool = False) -> torch.Event:
        return torch.Event(device="neuron", enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)


def current_stream(device: Device = None) -> Stream:
    s = torch.accelerator.current_stream(device_index(device))
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def default_stream(device: Device = None) -> Stream:
    i = device_index(device)
    kind = torch.accelerator.current_stream(i).device_type
    return Stream(stream_id=0, device_index=i, device_type=kind)


def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes `stream` the current stream of its device inside a `with` block, and restores
    the current streams of both the current device and the stream's device on exit (a
    None stream does nothing). Like torch.cuda.StreamContext."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self.idx = stream.device_index if stream is not None else -1
        self.src_prev_stream: torch.Stream | None = None
        self.dst_prev_stream: torch.Stream | None = None

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self.src_prev_stream = current_stream()
        if self.src_prev_stream.device_index != self.stream.device_index:
            self.dst_prev_stream = current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        if self.stream is None or self.src_prev_stream is None:
            return
        if self.dst_prev_stream is not None:
            torch.accelerator.set_stream(self.dst_prev_stream)
        torch.accelerator.set_stream(self.src_prev_stream)


def stream(stream: torch.Stream | None) -> StreamContext:
    """Context manager that selects `stream` (a StreamContext, as torch.cuda.stream)."""
    return StreamContext(stream)


# ---- random numbers ------------------------------------------------------------------------


def _generator(device: Device = None) -> torch.Generator:
    return _C._default_generator(device_index(device))


def default_generators_tuple() -> tuple[torch.Generator, ...]:
    return tuple(_C._default_generator(i) for i in range(device_count()))


# Seeding before the runtime starts is queued until it starts (as CUDA queues it), so
# torch.manual_seed, which seeds every registered device, neither fixes the core count nor
# fails; seeding an unavailable device does nothing, so it keeps working on CPU.


def _seeding(fn: Any) -> None:
    def run() -> None:
        if _state.config_error is None:
            fn()

    _state.when_started(run)


def manual_seed(seed: int) -> None:
    """Seeds the current core's generator (its state; draws without a generator use CPU's)."""
    _seeding(lambda: _generator().manual_seed(int(seed)))


def manual_seed_all(seed: int) -> None:
    """Seeds every core's generator (called by torch.manual_seed)."""

    def run() -> None:
        for g in default_generators_tuple():
            g.manual_seed(int(seed))

    _seeding(run)


def seed() -> None:
    _seeding(lambda: _generator().seed())


def seed_all() -> None:
    _seeding(lambda: manual_seed_all(_generator().seed()))


def initial_seed() -> int:
    return _generator().initial_seed()


def get_rng_state(device: Device = None) -> torch.Tensor:
    """The core's state as TorchNeuron's: 16 uint8, the seed (uint64) then the offset (int64,
    the 32-bit words drawn from this generator when passed explicitly; CPU's draws do not
    move it)."""
    return _generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Device = None) -> None:
    """Restores a state from `get_rng_state` (16 bytes), or a seed alone (8 bytes)."""
    _generator(device).set_state(new_state.cpu())


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators_tuple()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for g, s in zip(default_generators_tuple(), new_states, strict=True):
        g.set_state(s.cpu())


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        return default_generators_tuple()
    if name == "_initialized":  # what torch.utils.checkpoint reads before saving RNG states
        return _state.started()
    if name in ("get_dynamo_metrics", "reset_dynamo_metrics"):
        from neuronlocal.core import (
            dynamo_metrics as metrics,  # imported lazily: keeps `import torch` fast
        )

        return getattr(metrics, name)
    raise AttributeError(name)


# ---- autocast ------------------------------------------------------------------------------


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True
