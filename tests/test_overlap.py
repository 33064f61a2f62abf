"""Collectives overlapped with compute in the step estimate (estimate/overlap.py).

The schedule's rules on hand-made steps, its bounds on random ones, and dry runs of
data-parallel jobs (whose collectives run alongside compute: the overlapped step is
shorter) and of a tensor-parallel one (on the critical path: the two figures are equal).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from neuronlocal.estimate.overlap import BARRIER, GATHER, REDUCE, schedule


def _serial(items: list[tuple[float, float, str | None]]) -> float:
    return sum(before + comm for before, comm, _ in items)


def test_each_layer_takes_the_longer_of_its_compute_and_its_gather():
    # 0.5 s before the first gather, then two layers of 2 s compute behind 1 s gathers
    items = [(0.5, 1.0, GATHER), (2.0, 1.0, GATHER), (2.0, 0.0, BARRIER)]
    assert schedule(items) == pytest.approx(4.5) and _serial(items) == pytest.approx(6.5)
    # gathers longer than the compute: the link sets the pace, compute waits for each
    slow = [(0.0, 3.0, GATHER), (1.0, 3.0, GATHER), (1.0, 0.0, BARRIER)]
    assert schedule(slow) == pytest.approx(6.0)


def test_reductions_are_waited_for_at_the_optimizer_step_only():
    # two gradient reductions behind the backward, then the optimizer (after the barrier)
    items = [(1.0, 1.0, REDUCE), (1.0, 1.0, REDUCE), (1.0, 0.0, BARRIER), (1.0, 0.0, BARRIER)]
    assert schedule(items) == pytest.approx(4.0) and _serial(items) == pytest.approx(6.0)
    # the barrier waits for a reduction still on the link
    assert schedule([(1.0, 5.0, REDUCE), (0.0, 0.0, BARRIER), (1.0, 0.0, BARRIER)]) == \
        pytest.approx(7.0)


def test_blocking_collectives_are_on_the_critical_path_and_queue_on_the_link():
    items = [(1.0, 2.0, None), (3.0, 1.0, None), (1.0, 0.0, BARRIER)]
    assert schedule(items) == pytest.approx(_serial(items))
    # a blocking collective issued while a reduction holds the link waits for it
    assert schedule([(0.0, 2.0, REDUCE), (1.0, 1.0, None), (0.0, 0.0, BARRIER)]) == \
        pytest.approx(3.0)


def test_overlapped_lies_between_its_bounds_on_random_steps():
    """Never above the serial sum; never below the compute stream's own work (compute plus
    blocking collectives) nor the link's (every collective)."""
    rng = random.Random(0)
    for _ in range(500):
        items = [(rng.random(), rng.random(), rng.choice([None, GATHER, REDUCE, BARRIER]))
                 for _ in range(rng.randint(1, 12))]
        items = [(b, 0.0 if k == BARRIER else c, k) for b, c, k in items]
        got = schedule([*items, (0.0, 0.0, BARRIER)])
        stream = sum(b + (c if k is None else 0.0) for b, c, k in items)
        link = sum(c for _, c, _ in items)
        assert max(stream, link) - 1e-12 <= got <= _serial(items) + 1e-12, items


# ---- dry runs ------------------------------------------------------------------------------

DP = """\
    import sys, torch
    import torch.distributed as dist
    import torch.nn as nn
    dist.init_process_group("neuron")
    dev = torch.device("neuron")
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).to(dev)
    if sys.argv[1] == "ddp":  # small buckets: reduced during the backward, not after it
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, bucket_cap_mb=1)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(64, 512, device=dev)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    """
TP = """\
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).to("neuron")
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(64, 512, device="neuron")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    """


def _dry(tmp_path: Path, script: str, args: list[str]) -> tuple[dict, str]:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    out = tmp_path / "dry"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "neuronlocal", "run", "--dry-run",
                           "--nproc-per-node", "2", "--ranks", "0", "--report", str(out),
                           "job.py", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())["dry_run"], proc.stdout


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_collectives_overlap_compute(tmp_path, mode):
    """DDP's bucket all-reduces and FSDP2's gathers and reduce-scatters run alongside the
    compute: the overlapped step is shorter than the serial one, by no more than the
    collectives that ran alongside, and the band covers both figures."""
    s, stdout = _dry(tmp_path, DP, [mode])
    step, lapped, aside = s["step_s"], s["step_overlapped_s"], s["collectives_alongside_s"]
    assert 0 < aside <= s["step_parts_s"]["collectives"] + 1e-12
    assert step - aside - 1e-12 <= lapped < step
    lo, hi = s["step_band_s"]
    assert lo < lapped < step < hi
    assert any(a.startswith("step_overlapped_s:") for a in s["assumptions"])
    assert "with collectives overlapped" in stdout
    page = (tmp_path / "dry" / "report.html").read_text()
    assert "with collectives overlapped" in page and "step_overlapped_s:" in page


def test_tensor_parallel_collectives_stay_on_the_critical_path(tmp_path):
    """TP's all-reduces (DTensor's functional collectives) are waited for where issued:
    nothing runs alongside, and the overlapped step is the serial one."""
    s, _ = _dry(tmp_path, TP, [])
    assert s["step_parts_s"]["collectives"] > 0
    assert s["collectives_alongside_s"] == 0
    assert s["step_overlapped_s"] == s["step_s"]
