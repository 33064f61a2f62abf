"""torch.neuron device module, registration and torch.accelerator."""

from __future__ import annotations

import pytest
import torch

import neuronlocal


def test_registration_and_methods():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.neuron.is_available() and torch.neuron.is_initialized()
    t = torch.ones(2).neuron()
    assert t.device == torch.device("neuron:0") and t.is_neuron
    m = torch.nn.Linear(2, 2).neuron()
    assert m.weight.device.type == "neuron"
    assert torch.ones(2).untyped_storage().neuron().device.type == "neuron"


def test_device_count_and_selection():
    assert torch.neuron.device_count() == neuronlocal.profile.device_count == 4
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(2):
        assert torch.neuron.current_device() == 2
        assert torch.empty(1, device="neuron").device.index == 2
    assert torch.neuron.current_device() == 0
    with pytest.raises(ValueError, match="Invalid device id: 7. Valid range is 0 to 3"):
        torch.neuron.set_device(7)
    with pytest.raises(RuntimeError, match="Device index 9 is out of range"):
        torch.empty(1, device="neuron:9")


def test_accelerator():
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == 4
    torch.accelerator.set_device_index(1)
    try:
        assert torch.neuron.current_device() == 1
        torch.accelerator.synchronize()
    finally:
        torch.accelerator.set_device_index(0)


def test_properties_and_names():
    props = torch.neuron.get_device_properties(1)
    assert props.total_memory == 24 * 2**30
    assert props.name == neuronlocal.profile.instance.split(".")[0] == "trn2"
    assert torch.neuron.get_device_name(3) == "neuron:3"
    assert torch.neuron.get_device_name() == "neuron:0"
    assert torch.neuron.get_device_name(torch.device("neuron:2")) == "neuron:2"
    with pytest.raises(ValueError, match="expected torch.device or int"):
        torch.neuron.get_device_name("neuron:0")
    assert torch.neuron.is_bf16_supported()
    assert torch.bfloat16 in torch.neuron.get_amp_supported_dtype()


def test_streams_and_events():
    s = torch.neuron.Stream()
    assert isinstance(s, torch.Stream)
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream().stream_id == s.stream_id
    assert torch.neuron.current_stream().stream_id == torch.neuron.default_stream().stream_id
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    assert isinstance(start, torch.neuron.Event)
    start.record()
    torch.randn(64, 64, device="neuron").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0
    assert s.query()
    s.synchronize()
    torch.neuron.synchronize()


def test_stream_context_restores_both_devices():
    """torch.neuron.stream() returns a StreamContext; leaving it restores the current stream
    of the current device and of the stream's device."""
    s1 = torch.neuron.Stream(device=1)
    ctx = torch.neuron.stream(s1)
    assert isinstance(ctx, torch.neuron.StreamContext) and ctx.stream is s1
    before0, before1 = torch.neuron.current_stream(0), torch.neuron.current_stream(1)
    with ctx:
        assert torch.neuron.current_stream(1).stream_id == s1.stream_id
    assert torch.neuron.current_stream(0) == before0
    assert torch.neuron.current_stream(1) == before1
    assert torch.neuron.current_device() == 0
    with torch.neuron.stream(None):
        assert torch.neuron.current_stream() == before0


# Public names of TorchNeuron's `torch_neuronx` package, read from its `__init__.py` in the
# public development snapshot paired with torch 2.13 (TorchNeuron 2.13.3.0 family). Left out:
# its `distributed` and `python_ops` subpackages (its process-group backend and op
# registrations; here `torch.distributed` with backend "neuron" and the C++ dispatch).
TORCHNEURON_TOP_LEVEL = {
    "Event", "NeuronProfiler", "Stream", "StreamContext", "clear_op_tracking", "current_device",
    "current_stream", "default_stream", "device", "device_count", "empty_cache",
    "get_device_properties", "get_dynamo_metrics", "get_executed_ops", "get_fallback_ops",
    "is_neuron_runtime_initialized", "max_memory_allocated", "max_memory_reserved",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary", "neuron", "nki_op",
    "profiling", "reset_accumulated_memory_stats", "reset_dynamo_metrics",
    "reset_peak_memory_stats", "set_device", "set_stream", "stream", "synchronize", "wrap_nki",
}
TORCHNEURON_PRIVATE_USED = {"_C", "_lazy_init", "_get_device_index", "_is_in_bad_fork"}


def test_torch_neuronx_exports_torchneuron_names():
    import torch_neuronx

    public = {n for n in dir(torch_neuronx) if not n.startswith("_")}
    assert TORCHNEURON_TOP_LEVEL - public == set()
    assert TORCHNEURON_TOP_LEVEL <= set(torch_neuronx.__all__)
    assert all(hasattr(torch_neuronx, n) for n in TORCHNEURON_PRIVATE_USED)


def test_torch_neuronx_device_api_delegates_to_torch_neuron():
    import torch_neuronx

    assert torch_neuronx.neuron is torch.neuron
    assert torch_neuronx.device_count() == torch.neuron.device_count() == 4
    torch_neuronx._lazy_init()
    assert torch_neuronx.is_neuron_runtime_initialized()
    torch_neuronx.set_device(2)
    try:
        assert torch_neuronx.current_device() == 2 == torch.empty(1, device="neuron").device.index
        assert torch_neuronx.current_stream().device_index == 2
    finally:
        torch_neuronx.set_device(0)
    with pytest.raises(ValueError, match="Invalid device id: 4"):
        torch_neuronx.set_device(4)
    with pytest.raises(ValueError, match="Invalid device id"):
        torch_neuronx.get_device_properties(9)
    assert torch_neuronx.get_device_properties("neuron:1").total_memory == 24 * 2**30
    s = torch_neuronx.Stream()
    with torch_neuronx.stream(s):
        assert torch_neuronx.current_stream() == s
    assert torch_neuronx.default_stream().stream_id == 0
    e = torch_neuronx.Event(enable_timing=True)
    assert isinstance(e, torch_neuronx.Event)
    x = torch.ones(256, device="neuron")
    assert torch_neuronx.memory_allocated() == torch.neuron.memory_allocated() >= x.nbytes
    assert torch_neuronx._get_device_index(None, optional=True) is None
    with pytest.raises(ValueError, match="Expected neuron device, got cpu"):
        torch_neuronx._get_device_index("cpu")
    assert torch_neuronx._C._get_default_generator(0) is torch.neuron._generator(0)


def test_torch_neuronx_raw_transfer_bindings():
    """TorchNeuron's raw transfer helpers copy bytes as they are (no cast), contiguous only,
    same byte count, device to device within one core."""
    import torch_neuronx

    C = torch_neuronx._C
    src = torch.arange(6, dtype=torch.float32)
    dev = torch.empty(6, device="neuron")
    C._nrt_copy_cpu_to_neuron_tensor(src, dev)
    assert torch.equal(dev.cpu(), src)
    raw = torch.empty(6, dtype=torch.int32)
    C._nrt_copy_neuron_to_cpu_tensor(dev, raw)
    assert torch.equal(raw, src.view(torch.int32))
    other = torch.empty(2, 3, device="neuron")
    C._nrt_copy_neuron_to_neuron_tensor(dev.view(3, 2).t(), other)  # made contiguous first
    assert torch.equal(other.cpu(), src.view(3, 2).t())
    with pytest.raises(RuntimeError, match="same number of bytes"):
        C._nrt_copy_cpu_to_neuron_tensor(torch.ones(5), dev)
    with pytest.raises(RuntimeError, match="Destination tensor must be contiguous"):
        C._nrt_copy_neuron_to_cpu_tensor(dev, torch.empty(6, 2)[:, 0])
    with pytest.raises(RuntimeError, match="Source tensor must be CPU tensor"):
        C._nrt_copy_cpu_to_neuron_tensor(dev, dev)
    with pytest.raises(RuntimeError, match="same Neuron core"):
        C._nrt_copy_neuron_to_neuron_tensor(dev, torch.empty(6, device="neuron:1"))


def test_torch_neuronx_sets_release_build_variables(fresh_python):
    """`import torch_neuronx` sets TorchNeuron's build variables to the release values; a
    value the user set wins."""
    r = fresh_python("import os, torch_neuronx.utils as u; print(u.use_mlir_aten_ops(), "
                     "u.is_sync_mode_enabled(), "
                     "os.environ['TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS'])",
                     env={"TORCH_NEURONX_MLIR_ATEN_OPS": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "0"]


def test_neuron_profiler_writes_pytorch_trace(tmp_path):
    from torch.profiler import ProfilerActivity

    import torch_neuronx

    with torch_neuronx.NeuronProfiler(pytorch_activities=[ProfilerActivity.CPU],
                                      neuron_output_dir=str(tmp_path)) as prof:
        assert prof.is_active()
        torch.ones(4, device="neuron").sum()
    assert "aten::sum" in (tmp_path / "pytorch_trace.json").read_text()


def test_rng_matches_cpu_and_state():
    torch.manual_seed(123)
    a = torch.randn(8)
    torch.manual_seed(123)
    b = torch.randn(8, device="neuron")
    assert torch.equal(a, b.cpu())
    state = torch.neuron.get_rng_state()
    x = torch.rand(4, device="neuron")
    torch.neuron.set_rng_state(state)
    assert torch.equal(x, torch.rand(4, device="neuron"))
    torch.neuron.manual_seed(5)
    assert torch.neuron.initial_seed() == 5


def test_torch_neuronx_and_transformers_detection():
    transformers_utils = pytest.importorskip("transformers.utils")
    import torch_neuronx

    assert callable(torch_neuronx.get_fallback_ops)
    if hasattr(transformers_utils, "is_torch_neuron_available"):
        assert transformers_utils.is_torch_neuron_available()


def test_autoload_without_import(fresh_python):
    r = fresh_python("import torch; x = torch.randn(4, 4, device='neuron:1'); "
                     "print(x.device, torch.neuron.memory_allocated(1))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "neuron:1" and int(r.stdout.split()[1]) > 0


def test_forked_child_is_seeded_like_cpu():
    """Host memory survives fork, so a forked child (DataLoader worker, forkserver row) has a
    working device and torch.manual_seed seeds it: dropout masks equal CPU's."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_dropout_matches_cpu_after_seed)


def _dropout_matches_cpu_after_seed() -> bool:
    torch.manual_seed(2)
    want = torch.nn.functional.dropout(torch.ones(64), 0.5)
    torch.manual_seed(2)
    got = torch.nn.functional.dropout(torch.ones(64, device="neuron"), 0.5)
    return bool(torch.equal(got.cpu(), want))


_FORK_LOADER = """
import torch
from torch.utils.data import DataLoader, Dataset


class OnNeuron(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((2,), float(i), device="neuron"), torch.nn.Parameter(
            torch.ones(1, device="neuron"))


loader = DataLoader(OnNeuron(), batch_size=None, num_workers=2, timeout=30,
                    multiprocessing_context="fork")
got = [(x.device.type, x.tolist(), type(p).__name__, p.device.type) for x, p in loader]
print(got)
"""


def test_fork_dataloader_workers_returning_neuron_tensors_never_hang(fresh_python):
    """A forked worker's neuron tensors reach the main process on neuron (the worker sends
    them as shared CPU memory); the DataLoader timeout bounds the test if that breaks."""
    r = fresh_python(_FORK_LOADER, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "only available on CPU" not in r.stderr, r.stderr[-3000:]
    got = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list
    assert got == [("neuron", [float(i)] * 2, "Parameter", "neuron") for i in range(6)]


def test_amp_aliases_as_torch_cuda_amp():
    """Code ported from CUDA: torch.neuron.amp.autocast / GradScaler / custom_fwd train."""
    import torch.neuron.amp as amp

    assert amp is torch.neuron.amp
    model = torch.nn.Linear(8, 8).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(init_scale=4.0)
    with amp.autocast():
        out = model(torch.randn(4, 8, device="neuron"))
    assert out.dtype == torch.get_autocast_dtype("neuron")
    with amp.autocast(dtype=torch.bfloat16):
        assert model(torch.randn(4, 8, device="neuron")).dtype == torch.bfloat16
    before = model.weight.detach().clone()
    scaler.scale(out.float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0 and not torch.equal(before, model.weight.detach())

    class Double(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @amp.custom_bwd
        def backward(ctx, g):
            return g * 2

    with amp.autocast():
        y = Double.apply(torch.ones(2, device="neuron", dtype=torch.bfloat16))
    assert y.dtype == torch.float32
