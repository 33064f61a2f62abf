"""The `neuron` c10d backend (spec section 4), checked against plain CPU + gloo.

Multi-rank tests launch `tests/dist_jobs.py` under torchrun (2 to 4 ranks on localhost, gloo
underneath) and read what each rank wrote. The compiled training matrix and the example
are slow tests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).with_name("dist_jobs.py")
MODES = ("ddp", "fsdp", "tp", "tp_fsdp")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def torchrun(args: list[str], nproc: int, timeout: int = 400, env: dict[str, str] | None = None,
             extra: list[str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("NEURON_RT_VISIBLE_CORES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           *(extra or ["--standalone"]), str(JOBS), *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def results(out: Path, prefix: str, n: int) -> list[dict]:
    return [json.loads((out / f"{prefix}_{r}.json").read_text()) for r in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- in-process ----------------------------------------------------------------------------
def test_backend_registered_for_neuron_device():
    assert dist.Backend("neuron") == "neuron"
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert dist.Backend.backend_capability["neuron"] == ["neuron"]


@pytest.fixture
def single_rank():
    dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_single_rank_collectives_and_bad_input(single_rank):
    t = torch.arange(6., device="neuron")
    ptr = t.data_ptr()
    dist.all_reduce(t)
    assert t.device.type == "neuron" and t.data_ptr() == ptr
    torch.testing.assert_close(t.cpu(), torch.arange(6.))
    cpu = torch.ones(3)  # the group accepts CPU tensors too (compiled graphs pass aliases)
    dist.all_reduce(cpu)
    out = torch.empty(6, device="neuron")
    dist.all_gather_into_tensor(out, t)
    with pytest.raises(ValueError, match="numel"):
        dist.all_gather_into_tensor(torch.empty(5, device="neuron"), t)
    with pytest.raises(NotImplementedError, match="only even splits"):
        dist.all_to_all_single(out, out, [2, 4], [3, 3])
    with pytest.raises(ValueError, match="all_to_all supports only even splits"):
        dist.all_to_all([torch.empty(2, device="neuron")], [torch.empty(3, device="neuron")])


def test_too_many_ranks_per_node_is_a_clear_error(fresh_python):
    r = fresh_python("""
        import torch, neuronlocal.distributed as d
        d.bind_rank()
    """, env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "5", "NEURON_RT_VISIBLE_CORES": ""})
    assert r.returncode != 0
    assert "5 ranks on this node" in r.stderr and "4 logical NeuronCores" in r.stderr


def test_rank_binds_to_its_core(fresh_python):
    r = fresh_python("""
        import os, torch, neuronlocal.distributed as d
        d.bind_rank()
        print(torch.neuron.current_device(), os.environ["NEURON_RT_VISIBLE_CORES"])
    """, env={"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "NEURON_RT_VISIBLE_CORES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "2"]


# --- torchrun ------------------------------------------------------------------------------
def test_collectives_on_four_ranks(tmp_path):
    r = torchrun(["collectives", "--out", str(tmp_path)], 4)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank, res in enumerate(results(tmp_path, "collectives", 4)):
        assert res.pop("device") == f"neuron:{rank}"
        assert res.pop("visible") == str(rank)
        assert res.pop("backend") == "neuron"
        assert "only even splits" in res.pop("uneven_error")
        failed = [k for k, v in res.items() if v is not True]
        assert not failed, f"rank {rank}: {failed}"
        if rank == 1:
            assert "send_recv" in res
        if rank == 0:
            assert {"reduce", "gather"} <= set(res)


def _compare(out: Path, modes: tuple[str, ...], nproc: int, atol: float = 1e-5) -> None:
    for mode in modes:
        for rank in range(nproc):
            cpu = torch.load(out / f"{mode}_cpu_{rank}.pt")
            neu = torch.load(out / f"{mode}_neuron_{rank}.pt")
            torch.testing.assert_close(neu["loss"], cpu["loss"], atol=atol, rtol=1e-4)
            for key in ("grads", "params"):
                assert cpu[key].keys() == neu[key].keys()
                for name in cpu[key]:
                    torch.testing.assert_close(neu[key][name], cpu[key][name], atol=atol,
                                               rtol=1e-4, msg=f"{mode} rank {rank} {key} {name}")


def _train_both(out: Path, compiled: bool, modes: tuple[str, ...] = MODES) -> None:
    flags = ["--compiled", "--modes", ",".join(modes)] if compiled else []
    for device, backend in (("cpu", "gloo"), ("neuron", "neuron")):
        r = torchrun(["train", "--out", str(out), "--device", device, "--backend", backend,
                      *flags], 4, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]


def test_training_matches_cpu_gloo_rank_by_rank(tmp_path):
    """DDP, FSDP2, TP + sequence parallel, TP x FSDP (2x2), activation checkpointing."""
    _train_both(tmp_path, compiled=False)
    _compare(tmp_path, MODES, 4)


@pytest.mark.slow
@pytest.mark.xfail(reason="Dynamo treats the Python NeuronProcessGroup as an opaque object and "
                   "fails on compiled DDP (UnsafeScriptObjectError); not fixed yet", strict=False)
def test_compiled_training_matches_cpu_gloo_rank_by_rank(tmp_path):
    # TP x FSDP compiled is left out: stock PyTorch 2.13 fails it on CPU + gloo too
    # ("Could not resolve the process group registered under the name ...").
    modes = ("ddp", "fsdp", "tp")
    _train_both(tmp_path, compiled=True, modes=modes)
    _compare(tmp_path, modes, 4, atol=1e-4)


def test_two_node_torchrun_on_loopback(tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "neuronlocal-test"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("NEURON_RT_VISIBLE_CORES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *common,
           str(JOBS), "train", "--out", str(tmp_path), "--modes", "ddp"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, b = (torch.load(tmp_path / f"ddp_neuron_{r}.pt") for r in range(2))
    assert len(a["loss"]) == 3 and a["loss"] != b["loss"]  # different data per rank
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name])


def spawn(args: list[str], nproc: int, timeout: int = 200) -> list[int]:
    """Starts ranks directly (no torchrun agent, which would SIGTERM survivors of a dead rank
    before they can report what they saw); returns their exit codes."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.pop("NEURON_RT_VISIBLE_CORES", None)
        procs.append(subprocess.Popen([sys.executable, str(JOBS), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return [p.wait(timeout=timeout) for p in procs]


def test_dead_rank_fails_the_others_quickly(tmp_path):
    codes = spawn(["die", "--out", str(tmp_path)], 3)
    assert codes[1] == 3  # the rank that died
    for rank in (0, 2):
        res = json.loads((tmp_path / f"die_{rank}.json").read_text())
        assert res["error"].startswith("NeuronCollectiveError"), res
        assert "peer rank may have died" in res["error"]
        assert res["seconds"] < 25  # within the 20 s process-group timeout


def test_mismatched_shapes_and_dtypes_are_clear_errors(tmp_path):
    r = torchrun(["mismatch", "--out", str(tmp_path)], 2, env={"NEURONLOCAL_DIST_CHECKS": "1"},
                 timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    for res in results(tmp_path, "mismatch", 2):
        assert "torch.float32[4]" in res["shape"] and "torch.float32[5]" in res["shape"]
        assert "torch.int32[4]" in res["dtype"] and "mismatched inputs" in res["dtype"]


@pytest.mark.slow
def test_tp_fsdp_llama_example():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NEURON_RT_VISIBLE_CORES", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4", str(ROOT / "examples" / "tp_fsdp_llama.py"),
                        "--steps", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2 loss" in r.stdout
