"""Dry runs of TP x FSDP layouts: each group's link comes from its member ranks, and the
job's tokens per step count the data-parallel replicas, from the mesh the script built.

`init_device_mesh("neuron", (dp, tp))` puts each TP group on consecutive ranks and each
data-parallel group on ranks strided by tp. On trn2.48xlarge (4 logical cores per chip at
LNC=2) a TP group of 4 shares a chip while the data-parallel group of 4 beside it spans
chips, or instances: the same group size on different links.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MESH = """\
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size() // 4, 4),
                            mesh_dim_names=("dp", "tp"))
    p = torch.nn.Parameter(torch.zeros(2**16, device="neuron"))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(2):
        g = torch.ones_like(p)
        dist.all_reduce(g, group=mesh["tp"].get_group())          # 256 KiB over TP
        dist.all_reduce(g[: 2**15], group=mesh["dp"].get_group())  # 128 KiB over data parallel
        p.grad = g
        opt.step()
    """

# TP 4 inside FSDP2: the embedding row-wise with its indices replicated over the TP group
# (torchtitan's plan; RowwiseParallel's default input layout, Shard(-1), would instead
# gather the TP ranks' different ids into one 4 x 128 batch), the MLP column- then row-wise.
TP_FSDP = """\
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size() // 4, 4),
                            mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 128), nn.ReLU(),
                          nn.Linear(128, 512)).to("neuron")
    from torch.distributed.tensor import Replicate
    parallelize_module(model, mesh["tp"], {"0": RowwiseParallel(input_layouts=Replicate()),
                                           "1": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = torch.randint(0, 512, (4, 32), device="neuron")
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    """


def _run_dry(tmp_path: Path, args: list[str], timeout: int) -> Path:
    """`neuronlocal run --dry-run` on trn2.48xlarge with private caches; the report folder."""
    out = tmp_path / "dry"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff"),
           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks")}
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--dry-run",
                           "--report", str(out), "--instance", "trn2.48xlarge", *args],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _dry(tmp_path: Path, script: str, args: list[str]) -> dict:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    out = _run_dry(tmp_path, [*args, "job.py"], timeout=300)
    return json.loads((out / "report.json").read_text())["dry_run"]


@pytest.mark.parametrize(("layout", "dp_link"), [
    (["--nproc-per-node", "16"], "NeuronLink"),  # dp {0, 4, 8, 12}: 4 chips of 1 instance
    (["--nproc-per-node", "8", "--nnodes", "2"], "EFA"),  # ranks 8 and 12 on the second
])
def test_strided_groups_are_recorded_and_priced_on_their_members_link(tmp_path, layout,
                                                                      dp_link):
    s = _dry(tmp_path, MESH, [*layout, "--ranks", "0"])
    rows = {(c["op"], c["group_size"], c["link"]): c for c in s["collectives"]}
    tp, dp = rows[("all_reduce", 4, "same chip")], rows[("all_reduce", 4, dp_link)]
    assert (tp["calls"], tp["bytes"]) == (2, 2 * 2**18)
    assert (dp["calls"], dp["bytes"]) == (2, 2 * 2**17)
    assert 0 < tp["seconds_per_step"] < dp["seconds_per_step"]
    # the step prices each collective on the link its group's members cross, as the table
    assert s["step_parts_s"]["collectives"] == pytest.approx(
        sum(c["seconds_per_step"] for c in s["collectives"]))
    assert any("from its member ranks" in a for a in s["assumptions"])


def test_tokens_per_step_count_data_parallel_replicas_under_tp(tmp_path):
    """TP 4 x FSDP2 2 on 8 ranks: the 4 ranks of a TP group look up the same 4 x 32 ids, so
    the job feeds 128 x 8 / 4 = 256 tokens per step (not 128 x 8); --tokens-per-step still
    overrides."""
    s = _dry(tmp_path, TP_FSDP, ["--nproc-per-node", "8", "--ranks", "0"])
    assert s["tokens_per_step"] == 4 * 32 * 8 // 4
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["step_s"])
    assert any("4 ranks that looked up the same tokens" in a for a in s["assumptions"])
    given = _dry(tmp_path, TP_FSDP, ["--nproc-per-node", "8", "--ranks", "0",
                                     "--tokens-per-step", "1000"])
    assert given["tokens_per_step"] == 1000


BENCH = Path(__file__).parents[1] / "bench"


def _dry_bench(tmp_path: Path, script: str, args: list[str], script_args: list[str]
               ) -> tuple[dict, dict]:
    out = _run_dry(tmp_path, [*args, str(BENCH / script), *script_args], timeout=900)
    return (json.loads((out / "report.json").read_text())["dry_run"],
            json.loads((out / "rank0.json").read_text()))


SMALL = ["--layers", "2", "--hidden", "256", "--ffn", "512", "--heads", "8", "--kv", "4",
         "--vocab", "1024"]


@pytest.mark.slow
def test_trl_sft_under_fsdp2_dry_runs(tmp_path):
    """bench/dry_run_trl_sft.py at 2 layers on 4 ranks: TRL's SFTTrainer steps twice over
    FSDP2's collectives, model state is the closed form over the shards, every rank feeds
    its own batch, padded as TRL pads it on neuron."""
    s, rank0 = _dry_bench(tmp_path, "dry_run_trl_sft.py", ["--nproc-per-node", "4"],
                          [*SMALL, "--seq", "64"])
    assert [r["steps"] for r in s["ranks"]] == [2, 2]
    ops = {c["op"] for c in s["collectives"]}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops
    # q, o 256 x 256; k, v 256 x 128 (4 KV heads of 32); gate, up, down; two norms
    params = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 256 + 2 * 1024 * 256
    assert rank0["dry_run"]["model_state"]["parameters"] == params * 4 // 4  # fp32 / 4 ranks
    # TRL pads each batch to a multiple of 128 on a neuron device (its pad_to_multiple_of
    # "auto"): every rank looks up 128 positions, 64 of them padding
    assert s["tokens_per_step"] == 128 * 4
    assert all(r["fits"] for r in s["ranks"])


@pytest.mark.slow
def test_generate_at_tp_prices_prefill_and_decode_steps(tmp_path):
    """bench/dry_run_generate_tp.py at 2 layers on TP 4: the steps are the build, the
    prefill and each decode step; a decode step costs less than the prefill, and one TP
    group feeds the tokens (4 ranks share them)."""
    s, rank0 = _dry_bench(tmp_path, "dry_run_generate_tp.py",
                          ["--nproc-per-node", "4", "--steps", "0", "--ranks", "0"],
                          [*SMALL, "--prompt", "128", "--new", "3", "--max-len", "256"])
    steps = rank0["estimate"]["steps"]
    assert len(steps) == 1 + 3
    prefill, decode = steps[1], steps[-1]
    assert 0 < decode["estimated_s"] < prefill["estimated_s"]
    assert prefill["tokens"] == 128 and prefill["token_sharers"] == 4
    assert s["step_s"] == pytest.approx(decode["estimated_s"])
    assert any("argmax" in a for a in s["assumptions"])
