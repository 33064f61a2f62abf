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
    with pytest.raises(ValueError, match="neuron:7 does not exist"):
        torch.neuron.set_device(7)
    with pytest.raises(ValueError, match="does not exist"):
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
    assert props.name == "neuron:1"
    assert torch.neuron.get_device_name(3) == "neuron:3"
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
