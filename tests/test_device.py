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


def test_streams_and_events(monkeypatch):
    monkeypatch.setenv("NEURON_RT_ENABLE_HOST_CC", "1")  # a stream of its own
    s = torch.neuron.Stream()
    assert s != torch.neuron.default_stream()
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


def test_stream_context_restores_both_devices(monkeypatch):
    """torch.neuron.stream() returns a StreamContext; leaving it restores the current stream
    of the current device and of the stream's device."""
    monkeypatch.setenv("NEURON_RT_ENABLE_HOST_CC", "1")  # a stream of its own
    s1 = torch.neuron.Stream(device=1)
    assert s1 != torch.neuron.default_stream(1)
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


def test_random_ops_continue_cpus_stream():
    """TorchNeuron has no device kernel for normal_/uniform_/random_: its CPU fallback draws
    from CPU's global generator, so seed, draw on CPU, draw on neuron gives what drawing
    twice on CPU gives, and restoring CPU's state (not the core's) replays a neuron draw."""
    torch.manual_seed(123)
    want = [torch.randn(3, 4), torch.randn(3, 4), torch.rand(5), torch.randint(0, 9, (6,)),
            torch.empty(7).normal_(2.0, 3.0), torch.empty(7).uniform_(-1, 1),
            torch.empty(7).random_(0, 50), torch.randn(2)]
    torch.manual_seed(123)
    x = torch.randn(3, 4)
    xn = x.to("neuron")
    got = [x, torch.randn_like(xn), torch.rand(5, device="neuron"),
           torch.randint(0, 9, (6,), device="neuron"),
           torch.empty(7, device="neuron").normal_(2.0, 3.0),
           torch.empty(7, device="neuron").uniform_(-1, 1),
           torch.empty(7, device="neuron").random_(0, 50), torch.randn(2)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    assert got[1].device.type == "neuron"
    state = torch.get_rng_state()
    a = torch.rand(4, device="neuron")
    torch.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="neuron").cpu(), a.cpu())
    torch.manual_seed(9)
    b = torch.rand(4, device="neuron")
    torch.manual_seed(9)
    torch.neuron.manual_seed(5)  # the core's state only, as TorchNeuron's
    assert torch.neuron.initial_seed() == 5
    assert torch.equal(torch.rand(4, device="neuron").cpu(), b.cpu())


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


_SPAWN_ARGS = """
import torch
import torch.multiprocessing as mp


def child(x, p, q):
    q.put((x * 2, p.device.type, type(p).__name__, p.requires_grad))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=child, args=(torch.arange(4.0, device="neuron") + 1,
                                           torch.nn.Parameter(torch.ones(2, device="neuron")), q))
    proc.start()
    y, *facts = q.get(timeout=120)
    proc.join(120)
    print([proc.exitcode, y.device.type, y.tolist(), *facts])
"""


def test_neuron_tensors_passed_to_a_spawned_process_arrive(tmp_path, fresh_python):
    """A neuron tensor (and Parameter) as an argument of a spawn-context process arrives on
    neuron in the child, and one the child sends back arrives too: the pickle carries the
    tensor's bytes, not shared memory of a CPU copy freed before the child opens it."""
    path = tmp_path / "spawned.py"
    path.write_text(_SPAWN_ARGS)
    r = fresh_python(f"import runpy; runpy.run_path({str(path)!r}, run_name='__main__')",
                     timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list
    assert got == [0, "neuron", [2.0, 4.0, 6.0, 8.0], "neuron", "Parameter", True]


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


# ---- the runtime starts at the first device use ------------------------------------------------

_LATE_CORES = """
import os, torch
print(torch.neuron.is_initialized())
torch.manual_seed(3)  # queued until the runtime starts: it does not fix the core count
os.environ.update({VARS})
x = torch.ones(2, device="neuron")
os.environ["NEURON_RT_VISIBLE_CORES"] = "0"  # after the start: fixed, as a runtime is
print(torch.neuron.is_initialized(), torch.neuron.device_count(),
      torch.accelerator.device_count(),
      [torch.neuron.get_device_properties(i).physical_core_id
       for i in range(torch.neuron.device_count())], torch.neuron.initial_seed())
"""


@pytest.mark.parametrize(("variables", "count", "cores"), [
    ({"NEURON_RT_VISIBLE_CORES": "1-2"}, 2, [1, 2]),
    ({"NEURON_RT_NUM_CORES": "1"}, 1, [0]),
    ({"NEURON_RT_VISIBLE_CORES": "1,3", "NEURON_RT_NUM_CORES": "1"}, 1, [1]),
])
def test_core_variables_set_after_import_are_read_at_first_use(fresh_python, variables, count,
                                                               cores):
    r = fresh_python(_LATE_CORES.replace("{VARS}", repr(variables)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1] == f"True {count} {count} {cores} 3"


def test_one_visible_core_after_import_makes_other_indices_errors(fresh_python):
    r = fresh_python("""
        import os, torch
        os.environ["NEURON_RT_NUM_CORES"] = "1"
        torch.empty(1, device="neuron")
        for use in (lambda: torch.neuron.device(1).__enter__(),
                    lambda: torch.ones(1).to("neuron:1")):
            try:
                use()
            except Exception as e:
                print(type(e).__name__, str(e).split(" (")[0])
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "ValueError Invalid device id: 1. Valid range is 0 to 0",
        "RuntimeError Device index 1 is out of range. Valid range is 0 to 0 for this process"]


def test_bad_core_variable_set_after_import_fails_on_use_not_import(fresh_python):
    r = fresh_python("""
        import os, warnings, torch
        os.environ["NEURON_RT_NUM_CORES"] = "many"
        warnings.simplefilter("ignore")
        print(torch.neuron.is_available())
        try:
            torch.ones(1, device="neuron")
        except RuntimeError as e:
            print(str(e))
        """)
    assert r.returncode == 0, r.stderr
    available, error = r.stdout.splitlines()
    assert available == "False"
    assert error.startswith("neuron device unavailable: NEURON_RT_NUM_CORES='many' is not a "
                            "number of cores")


# ---- random numbers: TorchNeuron's generator state ---------------------------------------------


def _state(device: int = 0) -> tuple[int, int]:
    s = torch.neuron.get_rng_state(device)
    assert s.dtype == torch.uint8 and s.shape == (16,)
    return int(s[:8].view(torch.int64)), int(s[8:].view(torch.int64))


def test_rng_state_is_seed_and_offset():
    """16 bytes as TorchNeuron's: the seed, then the offset. Draws without a generator come
    from CPU's global generator and leave the core's state as it is (TorchNeuron's eager
    draws never reach its generator); a neuron generator passed in counts the 32-bit words
    it drew (one per float32 uniform)."""
    torch.manual_seed(11)
    assert _state() == (11, 0)
    torch.rand(5, device="neuron")
    torch.nn.functional.dropout(torch.ones(64, device="neuron"), 0.5)
    assert _state() == (11, 0)
    gen = torch.Generator(device="neuron").manual_seed(11)
    torch.rand(5, device="neuron", generator=gen)
    assert gen.get_offset() == 5
    torch.rand(2000, device="neuron", generator=gen)  # past the engine's 624-word block
    assert gen.initial_seed() == 11 and gen.get_offset() == 2005
    default = torch_neuronx_default_generator(0)
    assert default.device == torch.device("neuron:0") and default.get_offset() == 0


def torch_neuronx_default_generator(index: int) -> torch.Generator:
    import torch_neuronx

    return torch_neuronx._C._get_default_generator(index)


@pytest.mark.parametrize("fresh", [False, True])
def test_rng_state_restores_the_stream(fresh):
    """A neuron generator's state read here is restored exactly; one from elsewhere (a fresh
    generator has not seen it) is rebuilt from seed and offset, and draws the same numbers."""
    source = torch.Generator(device="neuron").manual_seed(5)
    torch.rand(1500, device="neuron", generator=source)
    torch.randn(64, device="neuron", generator=source)
    state = source.get_state()
    want = [torch.rand(1000, device="neuron", generator=source).cpu(),
            torch.randint(0, 9, (64,), device="neuron", generator=source).cpu()]
    gen = torch.Generator(device="neuron") if fresh else source
    gen.set_state(state.clone())
    got = [torch.rand(1000, device="neuron", generator=gen).cpu(),
           torch.randint(0, 9, (64,), device="neuron", generator=gen).cpu()]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert gen.get_state()[8:].tolist() == source.get_state()[8:].tolist()


def test_rng_state_accepts_a_seed_alone_and_refuses_other_sizes():
    seed = torch.tensor([7], dtype=torch.int64).view(torch.uint8)
    torch.neuron.set_rng_state(seed)
    assert _state() == (7, 0)
    gen = torch.Generator(device="neuron")
    gen.set_state(seed)
    assert torch.equal(torch.rand(3, device="neuron", generator=gen).cpu(),
                       torch.rand(3, generator=torch.Generator().manual_seed(7)))
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.neuron.set_rng_state(torch.get_rng_state())  # CPU's 5056-byte state


def test_a_set_core_state_draws_its_own_stream_until_reseeded():
    """DTensor's random-number tracker sets the core's (seed, offset) for each random op
    inside torch.random.fork_rng, which then restores CPU's generator: draws from CPU's
    would repeat in every region (and trunc_normal_'s redraw loop would never end). Once
    set, the core's state is the stream, distinct per offset; torch.manual_seed returns
    draws to CPU's stream."""
    torch.manual_seed(3)
    first = torch.randn(4, device="neuron").cpu()
    seen = []
    for offset in (0, 0, 64):
        state = torch.tensor([9, offset], dtype=torch.int64).view(torch.uint8)
        with torch.random.fork_rng(device_type="neuron"):
            torch.neuron.set_rng_state(state)
            cpu_before = torch.get_rng_state()
            seen.append(torch.randn(4, device="neuron").cpu())
            seen.append(torch.nn.functional.dropout(torch.ones(64, device="neuron"), 0.5).cpu())
            assert torch.equal(cpu_before, torch.get_rng_state())  # CPU's stream untouched
            assert _state()[1] > offset  # the draw moved the core's offset
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])  # same state
    assert not torch.equal(seen[0], seen[4]) and not torch.equal(seen[1], seen[5])
    torch.manual_seed(3)
    assert torch.equal(torch.randn(4, device="neuron").cpu(), first)


def test_new_generator_reports_its_neuron_device():
    with torch.neuron.device(2):
        g = torch.Generator(device="neuron")
    assert g.device == torch.device("neuron:2")
    assert len(g.get_state()) == 16


# ---- streams -----------------------------------------------------------------------------------


def test_new_streams_are_the_default_stream_unless_host_cc(monkeypatch):
    """TorchNeuron's single-stream mode: without NEURON_RT_ENABLE_HOST_CC=1 (read at each
    call) a new stream is the device's default stream."""
    monkeypatch.delenv("NEURON_RT_ENABLE_HOST_CC", raising=False)
    assert torch.neuron.Stream() == torch.neuron.default_stream()
    assert torch.neuron.Stream(device=1) == torch.neuron.default_stream(1)
    monkeypatch.setenv("NEURON_RT_ENABLE_HOST_CC", "1")
    a, b = torch.neuron.Stream(), torch.neuron.Stream()
    assert a != b and a != torch.neuron.default_stream()


def test_eager_checkpoint_replays_the_dropout_mask():
    """torch.utils.checkpoint saves and restores CPU's generator state, which dropout on
    neuron draws from (and the core's, once `torch.neuron._initialized` says the runtime
    runs): recomputed masks are the forward's."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(16, 16).to("neuron")
    x = torch.randn(8, 16, device="neuron", requires_grad=True)
    grads = []
    for use in (False, True):
        torch.manual_seed(1)
        fn = lambda y: torch.nn.functional.dropout(lin(y), 0.5).relu()  # noqa: E731
        (checkpoint(fn, x, use_reentrant=False) if use else fn(x)).sum().backward()
        grads.append(x.grad.cpu())
        x.grad = None
    assert torch.equal(grads[0], grads[1])
