"""HBM accounting per logical NeuronCore: torch.neuron's memory API.

Counters are process-wide and other tests leave tensors behind, so every assertion here is
about a delta from a baseline taken after `gc.collect()`, on the core the test uses.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

import neuronlocal
import torch_neuronx
from neuronlocal.core.config import ConfigError, parse_bytes
from neuronlocal.core.units import fmt_bytes

MiB = 2**20
GiB = 2**30
HBM = 24 * GiB  # trn2.3xlarge, LNC=2 (the default profile the tests run under)


def allocated() -> list[int]:
    gc.collect()
    return [torch.neuron.memory_allocated(i) for i in range(torch.neuron.device_count())]


def stats(device: int) -> dict[str, int]:
    return dict(torch.neuron.memory_stats(device))


def check_invariants(device: int) -> None:
    s = stats(device)
    for pool in ("all", "small_pool", "large_pool"):
        reserved = s[f"reserved_bytes.{pool}.current"]
        alloc = s[f"allocated_bytes.{pool}.current"]
        active = s[f"active_bytes.{pool}.current"]
        assert reserved >= alloc >= active >= 0, (pool, reserved, alloc, active)
        for key in ("allocated_bytes", "reserved_bytes", "active_bytes"):
            cur, peak = s[f"{key}.{pool}.current"], s[f"{key}.{pool}.peak"]
            done, freed = s[f"{key}.{pool}.allocated"], s[f"{key}.{pool}.freed"]
            assert peak >= cur and done - freed == cur, (key, pool, s)


# ---- accounting per core ---------------------------------------------------------------------


def test_allocation_is_counted_on_its_own_core():
    before = allocated()
    x = torch.empty(1000, device="neuron:2")  # 4000 bytes -> 4096 (256-byte size classes)
    after = allocated()
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 0, 4096, 0]
    with torch.neuron.device(3):
        y = torch.empty(10, device="neuron")  # current core is 3
        z = y + 1  # a result adopted from the CPU kernel counts on its input's core
    assert y.device == z.device == torch.device("neuron:3")
    assert allocated()[3] - before[3] == 2 * 256
    del x, y, z
    assert allocated() == before
    for i in range(4):
        check_invariants(i)


@pytest.mark.parametrize(("nbytes", "counted"), [
    (1, 256), (100, 256), (256, 256), (257, 512), (4000, 4096),
    # 1 MiB..16 MiB: rounded up to a multiple of a quarter of the next power of two
    (3 * MiB + 1, 4 * MiB), (5 * MiB, 6 * MiB), (9 * MiB, 12 * MiB),
])
def test_size_classes(nbytes, counted):
    before = torch.neuron.memory_allocated(1)
    x = torch.empty(nbytes, dtype=torch.uint8, device="neuron:1")
    assert torch.neuron.memory_allocated(1) - before == counted
    del x
    assert torch.neuron.memory_allocated(1) == before


def test_large_requests_are_not_rounded_to_classes():
    n = 16 * MiB + 1000
    before = torch.neuron.memory_allocated(1)
    x = torch.empty(n, dtype=torch.uint8, device="neuron:1")
    # Only aligned to 512 bytes, not to a size class.
    assert torch.neuron.memory_allocated(1) - before == 16 * MiB + 1024
    del x


def test_views_and_inplace_allocate_nothing():
    x = torch.zeros(64, 64, device="neuron:1")
    before = allocated()
    views = [x.view(-1), x[1:], x.t(), x.diagonal(), x.unsqueeze(0), x.expand(2, 64, 64)]
    x.add_(1).mul_(2)
    views[1].sub_(1)
    assert allocated() == before
    assert all(v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for v in views)
    assert x[0, 0].item() == 2.0 and x[1, 0].item() == 1.0


def test_copies_between_cores_are_counted_on_the_destination():
    src = torch.randn(256, device="neuron:0")
    before = allocated()
    dst = src.to("neuron:3")
    assert [a - b for a, b in zip(allocated(), before, strict=True)] == [0, 0, 0, 1024]
    assert torch.equal(dst.cpu(), src.cpu())
    del dst
    assert allocated() == before


def test_out_resize_and_storage_resize_stay_on_their_core():
    before = allocated()
    out = torch.empty(0, device="neuron:2")
    torch.add(torch.ones(1000, device="neuron:2"), 1, out=out)  # out= resizes the result
    assert out.device == torch.device("neuron:2")
    # 4096 for `out`; the temporary ones(1000) is freed again
    assert [a - b for a, b in zip(allocated(), before, strict=True)] == [0, 0, 4096, 0]
    s = torch.UntypedStorage(16, device="neuron:1")
    s.resize_(4096)  # resized while the current core is 0
    assert s.device == torch.device("neuron:1") and s.nbytes() == 4096
    assert [a - b for a, b in zip(allocated(), before, strict=True)] == [0, 4096, 4096, 0]
    del out, s
    assert allocated() == before


def test_backward_on_core_1_counts_only_on_core_1():
    before = allocated()
    model = torch.nn.Linear(64, 64).to("neuron:1")
    x = torch.randn(32, 64, device="neuron:1")
    model(x).relu().sum().backward()
    grown = [a - b for a, b in zip(allocated(), before, strict=True)]
    assert grown[0] == grown[2] == grown[3] == 0 and grown[1] > 64 * 64 * 4
    del model, x
    assert allocated() == before


# ---- the API: stats, peaks, cache, summary ----------------------------------------------------


def test_memory_stats_counters():
    dev = 3
    torch.neuron.empty_cache(dev)
    torch.neuron.reset_accumulated_memory_stats(dev)
    torch.neuron.reset_peak_memory_stats(dev)
    s0 = stats(dev)
    assert s0["hbm_bytes"] == HBM
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{key}.{pool}.{field}" in s0
    assert s0["allocation_requests"] == s0["num_ooms"] == s0["num_alloc_retries"] == 0
    assert s0["allocated_bytes.all.allocated"] == s0["allocated_bytes.all.freed"] == 0

    big = torch.empty(3 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    small = torch.empty(100, dtype=torch.uint8, device=f"neuron:{dev}")
    s1 = stats(dev)
    assert s1["allocation_requests"] == 2
    assert s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == 3 * MiB + 256
    assert s1["allocated_bytes.large_pool.allocated"] == 3 * MiB
    assert s1["allocated_bytes.small_pool.allocated"] == 256
    assert s1["requested_bytes.all.allocated"] == 3 * MiB + 100
    assert s1["active_bytes.all.current"] == s1["allocated_bytes.all.current"]
    # both pools had to reserve a segment: reserved grows by at least what was allocated
    assert s1["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"] >= 3 * MiB + 256
    check_invariants(dev)

    del big
    s2 = stats(dev)
    assert s2["allocated_bytes.all.freed"] == 3 * MiB
    assert s2["allocated_bytes.all.current"] == s1["allocated_bytes.all.current"] - 3 * MiB
    assert s2["allocated_bytes.all.peak"] == s1["allocated_bytes.all.current"]
    assert s2["num_tensor_frees"] == s1["num_tensor_frees"] + 1
    # a freed block stays cached: reserved does not drop until empty_cache()
    assert s2["reserved_bytes.all.current"] == s1["reserved_bytes.all.current"]
    check_invariants(dev)
    del small


def test_peaks_and_reset():
    dev = 2
    torch.neuron.reset_peak_memory_stats(dev)
    base = torch.neuron.memory_allocated(dev)
    assert torch.neuron.max_memory_allocated(dev) == base
    assert torch.neuron.max_memory_reserved(dev) == torch.neuron.memory_reserved(dev)
    tmp = torch.empty(2 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    del tmp
    assert torch.neuron.memory_allocated(dev) == base
    assert torch.neuron.max_memory_allocated(dev) == base + 2 * MiB
    assert torch.neuron.max_memory_reserved(dev) >= base + 2 * MiB
    torch.neuron.reset_peak_memory_stats(dev)
    assert torch.neuron.max_memory_allocated(dev) == base
    torch.neuron.reset_max_memory_allocated(f"neuron:{dev}")
    assert torch.neuron.max_memory_allocated(torch.device("neuron", dev)) == base


def test_empty_cache_releases_cached_blocks():
    dev = 1
    x = torch.empty(8 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    del x
    gc.collect()
    cached = torch.neuron.memory_reserved(dev)
    assert cached - torch.neuron.memory_allocated(dev) >= 8 * MiB
    free_before, total = torch.neuron.mem_get_info(dev)
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved(dev) <= cached - 8 * MiB
    assert torch.neuron.memory_reserved(dev) >= torch.neuron.memory_allocated(dev)
    free_after, total_after = torch.neuron.mem_get_info(dev)
    assert total == total_after == HBM and free_after - free_before >= 8 * MiB
    check_invariants(dev)


def test_memory_stats_has_torchneurons_nested_keys():
    """TorchNeuron's memory_stats: each byte stat a dict of current, peak, allocated and freed,
    the same numbers as CUDA's flat keys; reset_peak_memory_stats brings peaks to current."""
    dev = 2
    keep = torch.empty(2 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    drop = torch.empty(3 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    del drop
    s = torch.neuron.memory_stats(dev)
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        assert s[key] == {f: s[f"{key}.all.{f}"] for f in ("current", "peak", "allocated",
                                                            "freed")}
    assert s["allocated_bytes"]["peak"] > s["allocated_bytes"]["current"] >= 2 * MiB
    for key in ("num_alloc_retries", "num_ooms", "num_tensor_frees", "allocation_requests"):
        assert isinstance(s[key], int)
    torch.neuron.reset_peak_memory_stats(dev)
    s = torch.neuron.memory_stats(dev)
    assert all(s[k]["peak"] == s[k]["current"]
               for k in ("allocated_bytes", "reserved_bytes", "active_bytes"))
    assert "Neuron Memory Summary, Device 2" in torch.neuron.memory_summary(dev)
    del keep


def test_memory_summary():
    dev = 1
    keep = torch.empty(3 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    text = torch.neuron.memory_summary(dev)
    s = stats(dev)
    lines = text.splitlines()
    assert lines[0] == f"Neuron Memory Summary, Device {dev} (neuron:{dev}, HBM per core 24.00 GiB)"
    rows = {line.split()[0]: line for line in lines[2:] if not line.startswith(" ")}
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        expected = [fmt_bytes(s[f"{key}.all.{f}"])
                    for f in ("current", "peak", "allocated", "freed")]
        assert rows[key].split()[1:] == " ".join(expected).split()
    for key in ("allocation_requests", "num_alloc_retries", "num_ooms"):
        assert rows[key].split() == [key, str(s[key])]
    assert "small_pool" in text and "small_pool" not in torch.neuron.memory_summary(
        dev, abbreviated=True)
    del keep


def test_torch_neuronx_exposes_the_same_api():
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "memory_stats", "reset_peak_memory_stats", "empty_cache",
                 "memory_summary"):
        assert getattr(torch_neuronx, name) is getattr(torch.neuron, name)


def test_bad_device_arguments():
    """A device that does not exist is TorchNeuron's RuntimeError, with the fix."""
    with pytest.raises(RuntimeError, match=r"Device index 9 is out of range.*neuron:9 does not "
                                           r"exist.*Use an index below 4"):
        torch.neuron.memory_allocated(9)
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        torch.neuron.memory_stats("neuron:4")
    with pytest.raises(ValueError, match="Expected a neuron device, got cpu"):
        torch.neuron.memory_allocated("cpu")
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.empty(1, device="neuron:4")


# ---- out of memory ------------------------------------------------------------------------------


def test_oom_names_core_request_and_budget_and_process_recovers():
    dev = 1
    before = stats(dev)
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(2**40, dtype=torch.uint8, device=f"neuron:{dev}")  # checked before allocating
    msg = str(info.value)
    assert "neuron:1 out of memory" in msg and "logical NeuronCore 1" in msg
    assert "tried to allocate 1024.00 GiB" in msg and "24.00 GiB of HBM" in msg
    assert "torch.neuron.empty_cache()" in msg  # and what to do about it
    after = stats(dev)
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    x = torch.ones(16, device=f"neuron:{dev}")
    assert (x * 2).sum().item() == 32.0


OOM_SCRIPT = """
import json, torch
out = {"hbm": torch.neuron.memory_stats()["hbm_bytes"],
       "props": torch.neuron.get_device_properties(0).total_memory}
keep = [torch.empty(4 * 2**20, dtype=torch.uint8, device="neuron") for _ in range(10)]
out["allocated"] = torch.neuron.memory_allocated()
try:
    more = [torch.empty(8 * 2**20, dtype=torch.uint8, device="neuron") for _ in range(10)]
except torch.OutOfMemoryError as e:
    out["error"] = str(e)
s = torch.neuron.memory_stats()
out["ooms"], out["retries"] = s["num_ooms"], s["num_alloc_retries"]
out["after_oom"] = torch.neuron.memory_allocated()
del keep
more = [torch.empty(8 * 2**20, dtype=torch.uint8, device="neuron") for _ in range(5)]
out["after_free"] = torch.neuron.memory_allocated()
del more
other = torch.empty(40 * 2**20, dtype=torch.uint8, device="neuron:1")  # its own 64 MiB
a = torch.ones(6 * 2**20, dtype=torch.uint8, device="neuron:2")
try:
    results = [a + 1 for _ in range(20)]  # results of ops count too
except torch.OutOfMemoryError as e:
    out["op_error"] = str(e)
out["core2"] = torch.neuron.memory_allocated(2)
out["sum"] = (a[:10] + 1).sum().item()
print(json.dumps(out))
"""


def test_oom_with_small_hbm_in_subprocess(fresh_python):
    r = fresh_python(OOM_SCRIPT, env={"NEURONLOCAL_HBM_PER_CORE": "64MiB"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["hbm"] == out["props"] == 64 * MiB
    assert out["allocated"] == 40 * MiB
    assert out["error"].startswith("neuron:0 out of memory: tried to allocate 8.00 MiB")
    assert "which has 64.00 MiB of HBM" in out["error"]
    assert out["ooms"] == 1 and out["retries"] >= 1
    assert out["after_oom"] == 40 * MiB  # the partial list was freed, `keep` is still alive
    assert out["after_free"] == 40 * MiB  # 5 x 8 MiB fit once `keep` was freed
    assert out["op_error"].startswith("neuron:2 out of memory: tried to allocate 6.00 MiB")
    assert out["core2"] == 6 * MiB
    assert out["sum"] == 20


SEGMENT_SCRIPT = """
import json, torch
out = {}
for n in (2**20, 2**19):  # a 1 MiB request takes a 20 MiB segment; 512 KiB a 2 MiB one
    try:
        torch.empty(n, dtype=torch.uint8, device="neuron")
        out[n] = None
    except torch.OutOfMemoryError as e:
        out[n] = str(e)
print(json.dumps(out))
"""


def test_oom_from_segment_rounding_says_so(fresh_python):
    r = fresh_python(SEGMENT_SCRIPT, env={"NEURONLOCAL_HBM_PER_CORE": "10MiB"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    msg = out[str(2**20)]
    assert msg.startswith("neuron:0 out of memory: tried to allocate 1.00 MiB")
    assert "which has 10.00 MiB of HBM" in msg
    assert "needs a new 20.00 MiB segment" in msg and "rounded up to a 1.00 MiB block" in msg
    assert "set NEURONLOCAL_HBM_PER_CORE to at least 20.00 MiB" in msg
    assert out[str(2**19)] is None  # a 2 MiB segment fits in 10 MiB


@pytest.mark.parametrize("raw", ["-1GiB", "12XB", "1.5.GiB", "GiB"])
def test_bad_hbm_sizes_are_rejected(raw):
    with pytest.raises(ConfigError, match="NEURONLOCAL_HBM_PER_CORE="):
        parse_bytes("NEURONLOCAL_HBM_PER_CORE", raw)


# ---- training leaves memory at its baseline ----------------------------------------------------


def _train(device: str, opt_name: str, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1),
    ).to(device)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g).to(device)
    y = torch.randn(32, 1, generator=g).to(device)
    torch.manual_seed(123)  # dropout masks: same stream on CPU and on neuron
    marks = {}
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if i == 1 and device != "cpu":  # optimizer state exists from step 1 on
            gc.collect()
            marks["base"] = torch.neuron.memory_allocated()
            marks["reserved"] = torch.neuron.memory_reserved()
            torch.neuron.reset_peak_memory_stats()
    params = [p.detach().cpu() for p in model.parameters()]
    if device != "cpu":
        gc.collect()
        marks["after"] = torch.neuron.memory_allocated()
        marks["reserved_after"] = torch.neuron.memory_reserved()
        marks["peak"] = torch.neuron.max_memory_allocated()
    return loss.item(), params, marks


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_training_1000_steps_returns_to_baseline(opt_name):
    gc.collect()
    start = torch.neuron.memory_allocated()
    loss, params, marks = _train("neuron", opt_name, 1000)
    assert marks["after"] == marks["base"]
    assert marks["reserved_after"] == marks["reserved"]  # the cache reaches a steady state
    # a step's transient memory is bounded (activations and grads of a tiny MLP), not growing
    assert marks["peak"] - marks["base"] < 64 * 1024
    cpu_loss, cpu_params, _ = _train("cpu", opt_name, 1000)
    assert loss == pytest.approx(cpu_loss, rel=1e-4, abs=1e-6)
    for p, q in zip(params, cpu_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    gc.collect()
    assert torch.neuron.memory_allocated() == start


def test_config_is_the_profile_budget():
    assert neuronlocal.profile.hbm_per_core == HBM
    assert all(stats(i)["hbm_bytes"] == HBM for i in range(4))


@pytest.mark.parametrize("reset", [
    torch.neuron.reset_peak_memory_stats, torch.neuron.reset_max_memory_allocated,
    torch_neuronx.reset_peak_memory_stats, torch.accelerator.reset_peak_memory_stats,
    lambda: torch._C._accelerator_resetPeakStats(torch.neuron.current_device())],
    ids=["neuron", "neuron_max_allocated", "torch_neuronx", "accelerator", "allocator"])
def test_report_peak_is_the_runs_high_water_mark_whatever_the_program_resets(reset):
    """torchtitan resets the peak counters every step: the run report still shows the run's
    peak per core, through whichever entry point the program resets (the allocator keeps
    the run's high-water mark apart), while the program's own peak restarts as it asked."""
    from neuronlocal.report import collect

    c = collect.Collector().start()
    try:
        big = torch.empty(32 * 2**20, dtype=torch.uint8, device="neuron")
        del big
        reset()
        small = torch.empty(2**20, dtype=torch.uint8, device="neuron")
        assert torch.neuron.max_memory_allocated() < 32 * 2**20
        assert torch.accelerator.max_memory_allocated() == torch.neuron.max_memory_allocated()
        reset()
        (core,) = [m for m in collect.memory() if m["core"] == torch.neuron.current_device()]
        assert core["peak_bytes"] >= 32 * 2**20 and core["reserved_peak_bytes"] >= 32 * 2**20
        del small
    finally:
        c.stop()
    c = collect.Collector().start()  # a new run starts its own high-water mark
    try:
        (core,) = [m for m in collect.memory() if m["core"] == torch.neuron.current_device()]
        assert core["peak_bytes"] < 32 * 2**20
    finally:
        c.stop()


def test_torch_accelerator_memory_api_reads_the_neuron_allocator():
    """torch.accelerator's memory functions reach the same counters as torch.neuron's."""
    dev = 1
    torch.neuron.empty_cache()
    x = torch.empty(4 * MiB, dtype=torch.uint8, device=f"neuron:{dev}")
    s, acc = torch.neuron.memory_stats(dev), torch.accelerator.memory_stats(dev)
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        for field in ("current", "peak", "allocated", "freed"):
            assert acc[f"{key}.all.{field}"] == s[f"{key}.all.{field}"], (key, field)
    assert torch.accelerator.memory_allocated(dev) == torch.neuron.memory_allocated(dev)
    assert torch.accelerator.get_memory_info(dev) == torch.neuron.mem_get_info(dev)
    del x
    torch.accelerator.empty_cache()
    assert torch.neuron.memory_reserved(dev) == torch.neuron.memory_allocated(dev) == 0
    torch.accelerator.reset_peak_memory_stats(dev)
    assert torch.neuron.max_memory_allocated(dev) == 0
