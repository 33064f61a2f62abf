"""torchtitan (PyTorch's LLM training platform) trains its llama3 debug model on neuron.

Slow tests, skipped when torchtitan is not importable. torchtitan is not part of the locked
environment: install it apart (docs/torchtitan.md) and put it on PYTHONPATH. Each job runs
tests/torchtitan_job.py under torchrun, in a folder holding the debug configs' assets
(made by `torchtitan_job.py --make-assets`), at a small size (seq 256, batch 2 per data-
parallel rank, 3 steps, seed 0), with selective activation checkpointing (torchtitan's
default). `--parallelism.spmd-backend partial_dtensor`: torchtitan 0.3.0's default
(`spmd_types`) hands torch 2.13's `fully_shard` plain parameters with `dp_mesh_dims`, which
it rejects on any device (a torch-version gap).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("torchtitan_job.py")
STEPS = 3
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(1800),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not importable (docs/torchtitan.md installs it)"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    subprocess.run([sys.executable, str(JOB), "--make-assets", str(root)], check=True)
    return root


def train(workdir: Path, nproc: int, *args: str, report: Path | None = None) -> list[float]:
    """Losses per step of one torchrun job (rank 0's log), optionally under `neuronlocal run`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NEURON_RT_VISIBLE_CORES", None)
    under = ["-m", "neuronlocal", "run", "--report", str(report)] if report else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), *under, str(JOB), "--module", "llama3", "--config", "llama3_debugmodel",
           "--training.steps", str(STEPS), "--training.seq-len", "256",
           "--training.local-batch-size", "2", "--debug.seed", "0",
           "--parallelism.spmd-backend", "partial_dtensor",
           "--checkpoint.no-enable", "--validator.no-enable", "--metrics.disable-color-printing",
           "--dump-folder", str(workdir / "out"), *args]
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    losses = {int(s): float(v) for s, v in _STEP.findall(r.stdout + r.stderr)}
    assert sorted(losses) == list(range(1, STEPS + 1)), (r.stdout + r.stderr)[-4000:]
    return [losses[s] for s in sorted(losses)]


def test_fsdp_equals_ddp_and_tp_fsdp_trains(workdir):
    """FSDP2 on 2 ranks (torchtitan's gradient divide factor 1.0: PREMUL_SUM reduce-scatters)
    with selective activation checkpointing gives DDP's losses on 2 ranks (the same seed,
    batches and arithmetic); TP 2 x FSDP 2 on 4 ranks trains (its weights are initialised
    per shard, so its losses are its own)."""
    ddp = train(workdir, 2, "--parallelism.data-parallel-replicate-degree", "2",
                "--parallelism.data-parallel-shard-degree", "1")
    fsdp = train(workdir, 2, "--parallelism.data-parallel-shard-degree", "2")
    assert fsdp == pytest.approx(ddp, abs=1e-4), (ddp, fsdp)
    tp_fsdp = train(workdir, 4, "--parallelism.data-parallel-shard-degree", "2",
                    "--parallelism.tensor-parallel-degree", "2")
    assert all(math.isfinite(v) and 6 < v < 9 for v in tp_fsdp), tp_fsdp


def test_fsdp_run_report_counts_each_step_once(workdir, tmp_path):
    """Under `neuronlocal run --report`, with selective activation checkpointing (torchtitan's
    default, around its compiled flex attention): the same losses as without the report,
    one step per training step on each rank (torchtitan's optimizer container steps the
    inner optimizers), each core's HBM peak is the run's, though torchtitan resets the peak
    counters every step, and RoPE's complex views (CPU fallbacks inside the checkpointed
    blocks) have the program's line as their site."""
    args = ("--parallelism.data-parallel-shard-degree", "2")
    losses = train(workdir, 2, *args, report=tmp_path / "rep")
    assert losses == train(workdir, 2, *args)
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [r["rank"] for r in rep["ranks"]] == [0, 1]
    for r in rep["ranks"]:
        assert len(r["estimate"]["steps"]) == STEPS
        (core,) = r["memory"]
        assert core["peak_bytes"] >= 64 * 2**20, core["peak_bytes"]
        ops = {f["op"]: f for f in r["fallback_ops"]}
        for op in ("aten::view_as_complex", "aten::view_as_real"):
            assert ops[op]["file"].endswith(".py") and ops[op]["source"], ops[op]
