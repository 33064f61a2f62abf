"""torchtitan (PyTorch's LLM training platform) trains its llama3 debug model on neuron.

Slow tests, skipped when torchtitan is not importable. torchtitan is not part of the locked
environment: install it apart (docs/torchtitan.md) and put it on PYTHONPATH. Each job runs
tests/torchtitan_job.py under torchrun, in a folder holding the debug configs' assets
(made by `torchtitan_job.py --make-assets`), at a small size (seq 256, batch 2 per data-
parallel rank, 3 steps, seed 0), with selective activation checkpointing (torchtitan's
default). `--parallelism.spmd-backend partial_dtensor`: torchtitan 0.3.0's default
(`spmd_types`) hands torch 2.13's `fully_shard` plain parameters with `dp_mesh_dims`, which
it rejects on any device (a torch-version gap). `cpu=True` runs the same job on plain CPU
PyTorch (`TITAN_DEVICE=cpu` in torchtitan_job.py, neuronlocal not loaded): the reference.
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
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")

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


def torchrun(cwd: Path, nproc: int, args: list[str], env: dict[str, str] | None = None,
             path: str | None = None) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of tests/torchtitan_job.py under torchrun (rank 0's log);
    `path` goes first on PYTHONPATH (a torchtitan checkout)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full.pop("NEURON_RT_VISIBLE_CORES", None)
    if path:
        full["PYTHONPATH"] = os.pathsep.join([path, full.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), *args]
    r = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    logged = {int(s): (float(v), float(g)) for s, v, g in _STEP.findall(r.stdout + r.stderr)}
    assert sorted(logged) == list(range(1, STEPS + 1)), (r.stdout + r.stderr)[-4000:]
    return [logged[s] for s in sorted(logged)]


def run_steps(workdir: Path, nproc: int, *args: str, report: Path | None = None,
              cpu: bool = False) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of the llama3 debug model, optionally under
    `neuronlocal run`, or on plain CPU PyTorch."""
    env = {"TITAN_DEVICE": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"} if cpu else {}
    under = ["-m", "neuronlocal", "run", "--report", str(report)] if report else []
    return torchrun(workdir, nproc, [
        *under, str(JOB), "--module", "llama3", "--config", "llama3_debugmodel",
        "--training.steps", str(STEPS), "--training.seq-len", "256",
        "--training.local-batch-size", "2", "--debug.seed", "0",
        "--parallelism.spmd-backend", "partial_dtensor",
        "--checkpoint.no-enable", "--validator.no-enable", "--metrics.disable-color-printing",
        "--dump-folder", str(workdir / "out"), *args], env)


def train(workdir: Path, nproc: int, *args: str, report: Path | None = None) -> list[float]:
    """Losses per step of one torchrun job on neuron (rank 0's log)."""
    return [loss for loss, _ in run_steps(workdir, nproc, *args, report=report)]


def test_one_process_equals_cpu(workdir):
    """One process on neuron gives plain CPU PyTorch's losses and gradient norms for the
    same steps (the llama3 debug model, seed 0, selective AC). The weights start equal (the
    DTensor random-number tracker's draws on neuron follow CPU's stream for the seed); the
    CPU run is torch's eager flex attention (dense), neuron's its compiled blockwise form,
    whose softmax sums in another order: losses within 2e-5 relative (seen: 9e-6), grad
    norms as torchtitan logs them (4 decimals)."""
    neuron = run_steps(workdir, 1)
    cpu = run_steps(workdir, 1, cpu=True)
    assert [v for v, _ in neuron] == pytest.approx([v for v, _ in cpu], rel=2e-5), (neuron, cpu)
    assert [g for _, g in neuron] == pytest.approx([g for _, g in cpu], abs=1e-4), (neuron, cpu)


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


PINNED = "0a2107f984639e23a0e5b07fc278785345f03b73"
_TUTORIAL_ARGS = {
    # the tutorials' single-core commands, 3 steps, seed 0; `--profiling.no_enable_profiling`:
    # the commit's profiler passes a None activity where there is no CUDA/XPU, which torch
    # 2.13's profiler rejects (a torch-version gap; profiling does not change the losses)
    "qwen3": ["--job.config_file", "qwen3_8b_tp4_fsdp.toml", "--model.flavor", "debugmodel",
              "--model.hf_assets_path", "./tests/assets/tokenizer",
              "--training.global_batch_size", "2", "--parallelism.tensor_parallel_degree", "1"],
    "gpt-oss": ["--job.config_file", "torchtitan/models/gpt_oss/train_configs/debug_model.toml",
                "--profiling.no_enable_profiling"],
}


@pytest.mark.skipif(not (os.environ.get("TORCHTITAN_PINNED_SRC")
                         and os.environ.get("TORCHNEURON_TITAN_DOCS")),
                    reason="needs TORCHTITAN_PINNED_SRC (torchtitan at the tutorials' commit) "
                           "and TORCHNEURON_TITAN_DOCS (TorchNeuron's docs/torchtitan), "
                           "from GitHub: docs/torchtitan.md")
@pytest.mark.parametrize("tutorial", sorted(_TUTORIAL_ARGS))
def test_tutorial_debug_model_at_pinned_commit(tutorial, workdir, tmp_path):
    """TorchNeuron's tutorials pin torchtitan 0a2107f9 and apply a diff each; that tree, with
    the diff applied, trains its debug model on one neuron core as the tutorial runs it
    (3 steps): finite losses, the last below the first."""
    import shutil

    src = Path(os.environ["TORCHTITAN_PINNED_SRC"])
    docs = Path(os.environ["TORCHNEURON_TITAN_DOCS"])
    tree = tmp_path / "torchtitan"
    shutil.copytree(src, tree, ignore=shutil.ignore_patterns(".git"))
    subprocess.run(["git", "apply", str(docs / tutorial / "TorchTitan.diff")], cwd=tree,
                   check=True)
    if tutorial == "qwen3":
        shutil.copy(docs / "qwen3" / "qwen3_8b_tp4_fsdp.toml", tree)
    data = tree / "tests" / "assets" / "c4_test"
    if not (data / "data.json").is_file():  # a Git LFS-sized file some snapshots lack
        data.mkdir(parents=True, exist_ok=True)
        shutil.copy(workdir / "tests" / "assets" / "c4_test" / "data.json", data)
    logged = torchrun(tree, 1, [str(JOB), *_TUTORIAL_ARGS[tutorial], "--training.steps",
                                str(STEPS), "--debug.seed", "0",
                                "--metrics.disable_color_printing"], path=str(tree))
    losses = [v for v, _ in logged]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], logged
