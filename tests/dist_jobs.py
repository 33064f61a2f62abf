"""torchrun jobs for tests/test_distributed.py: each writes per-rank results to --out.

`collectives`: every collective on neuron tensors (sync and async) against the expected
values, functional collectives eager and compiled. `train`: the validation pattern of
TorchNeuron (spec section 4): one job per (device, backend), DDP, FSDP2, TP (+ sequence
parallel) and TP x FSDP with activation checkpointing, dumping loss per step, grads and
parameters per rank for the test to compare. `die`: rank 1 exits mid-job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIM, HIDDEN, SEQ, BATCH, STEPS = 16, 32, 8, 4, 3


# --- collectives -------------------------------------------------------------------------
def collectives(out: Path) -> None:
    import torch.distributed._functional_collectives as fc

    dist.init_process_group(backend="neuron")
    r, w = dist.get_rank(), dist.get_world_size()
    dev = torch.device("neuron", torch.neuron.current_device())
    res: dict[str, Any] = {"device": str(dev), "backend": dist.get_backend(),
                           "visible": os.environ.get("NEURON_RT_VISIBLE_CORES")}

    def ok(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        res[name] = bool(got.device.type == "neuron"
                         and torch.allclose(got.cpu().float(), want.float(), atol=1e-5))

    ranks = torch.arange(w, dtype=torch.float32)
    for op, want in [(dist.ReduceOp.SUM, ranks.sum() + w), (dist.ReduceOp.PRODUCT,
                     (ranks + 1).prod()), (dist.ReduceOp.MIN, torch.tensor(1.)),
                     (dist.ReduceOp.MAX, torch.tensor(float(w)))]:
        for async_op in (False, True):
            t = torch.full((5,), float(r + 1), device=dev)
            work = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                work.wait()
            ok(f"all_reduce_{op}_{'async' if async_op else 'sync'}", t, want.expand(5))
    for op, want in [(dist.ReduceOp.BAND, 0), (dist.ReduceOp.BOR, (1 << w) - 1),
                     (dist.ReduceOp.BXOR, (1 << w) - 1)]:
        t = torch.tensor([1 << r], device=dev, dtype=torch.int32)
        dist.all_reduce(t, op=op)
        ok(f"all_reduce_{op}", t, torch.tensor([want]))
    fut_t = torch.ones(3, device=dev)
    fut = dist.all_reduce(fut_t, async_op=True).get_future()
    res["future_is_neuron"] = fut.wait()[0].device.type == "neuron"

    x = torch.full((2, 3), float(r), device=dev)
    outs = [torch.empty(2, 3, device=dev) for _ in range(w)]
    dist.all_gather(outs, x)
    ok("all_gather", torch.stack(outs), ranks.view(w, 1, 1).expand(w, 2, 3))
    big = torch.empty(2 * w, 3, device=dev)
    dist.all_gather_into_tensor(big, x, async_op=True).wait()
    ok("all_gather_into_tensor", big, ranks.repeat_interleave(2).view(-1, 1).expand(-1, 3))
    flat = torch.empty(2 * w * 3, device=dev)  # NCCL semantics: only element counts must match
    dist.all_gather_into_tensor(flat, x)
    ok("all_gather_into_tensor_flat", flat, ranks.repeat_interleave(6).float())
    src = torch.arange(2 * w, dtype=torch.float32, device=dev) + r
    o = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(o, src)
    want_rs = (torch.arange(2 * w, dtype=torch.float32) * w + ranks.sum())[2 * r: 2 * r + 2]
    ok("reduce_scatter_tensor", o, want_rs)
    o2 = torch.empty(2, device=dev)
    dist.reduce_scatter(o2, list(src.chunk(w)))
    ok("reduce_scatter", o2, want_rs)
    b = torch.full((4,), float(r), device=dev)
    dist.broadcast(b, src=w - 1)
    ok("broadcast", b, torch.full((4,), float(w - 1)))
    rd = torch.full((4,), float(r + 1), device=dev)
    dist.reduce(rd, dst=0)
    if r == 0:
        ok("reduce", rd, torch.full((4,), float(w * (w + 1) // 2)))
    a_in = torch.arange(w * 2, dtype=torch.float32, device=dev) + 100 * r
    a_out = torch.empty_like(a_in)
    dist.all_to_all_single(a_out, a_in)
    want_a2a = torch.tensor([100. * s + 2 * r + k for s in range(w) for k in range(2)])
    ok("all_to_all_single", a_out, want_a2a)
    l_out = [torch.empty(2, device=dev) for _ in range(w)]
    dist.all_to_all(l_out, list(a_in.chunk(w)))
    ok("all_to_all", torch.cat(l_out), want_a2a)
    try:
        dist.all_to_all_single(a_out, a_in, [1] + [2] * (w - 2) + [3], [2] * w)
        res["uneven_error"] = ""
    except NotImplementedError as e:
        res["uneven_error"] = str(e)
    g = torch.full((2,), float(r), device=dev)
    gl = [torch.empty(2, device=dev) for _ in range(w)] if r == 0 else None
    dist.gather(g, gl, dst=0)
    if r == 0:
        ok("gather", torch.stack(gl), ranks.view(w, 1).expand(w, 2))
    sc = torch.empty(2, device=dev)
    dist.scatter(sc, [torch.full((2,), float(i), device=dev) for i in range(w)] if r == 0
                 else None, src=0)
    ok("scatter", sc, torch.full((2,), float(r)))
    dist.barrier()
    p2p = torch.full((3,), float(r), device=dev)
    if r == 0:
        dist.send(p2p, dst=1)
    elif r == 1:
        dist.recv(p2p, src=0)
        ok("send_recv", p2p, torch.zeros(3))
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r), device=dev), (r + 1) % w),
           dist.P2POp(dist.irecv, recv_buf := torch.empty(2, device=dev), (r - 1) % w)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    ok("batch_isend_irecv", recv_buf, torch.full((2,), float((r - 1) % w)))

    # zero copy: the bytes gloo wrote are the neuron tensor's bytes, no extra allocation
    z = torch.ones(1 << 16, device=dev)
    ptr = z.data_ptr()
    torch.neuron.reset_peak_memory_stats()
    before = torch.neuron.memory_allocated()
    dist.all_reduce(z)
    res["zero_copy"] = bool(z.data_ptr() == ptr and torch.neuron.max_memory_allocated() == before)

    grp = dist.group.WORLD
    y = torch.full((4,), float(r + 1), device=dev)
    ok("fc_all_reduce", fc.all_reduce(y, "sum", grp), torch.full((4,), float(w * (w + 1) / 2)))
    ok("fc_all_gather", fc.all_gather_tensor(y, 0, grp), (ranks + 1).repeat_interleave(4))
    rs = fc.reduce_scatter_tensor(torch.arange(4. * w, device=dev), "sum", 0, grp)
    ok("fc_reduce_scatter", rs, torch.arange(4. * w)[4 * r:4 * r + 4] * w)
    ok("fc_all_to_all", fc.all_to_all_single(a_in, None, None, grp), want_a2a)

    @torch.compile(backend="neuron", fullgraph=True)
    def f(v: torch.Tensor) -> torch.Tensor:
        s = fc.all_reduce(v * 2, "sum", grp)
        gathered = fc.all_gather_tensor(s + 1, 0, grp)
        return fc.reduce_scatter_tensor(gathered, "sum", 0, grp) + fc.all_to_all_single(
            gathered, None, None, grp).view(w, -1).sum(0)

    total = 2 * w * (w + 1) / 2 + 1
    ok("fc_compiled", f(y), torch.full((4,), total * w + total * w))
    dist.destroy_process_group()
    (out / f"collectives_{r}.json").write_text(json.dumps(res))


# --- training validation -----------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, ac: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, DIM)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.ac else blk(x)
        return self.head(x)


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    plan: dict[str, Any] = {"blocks.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Shard(1),))}
    for i in range(2):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.w1"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.w2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def train(out: Path, device_type: str, backend: str, modes: list[str], compiled: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend=backend)
    r, w = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    dev = torch.device("neuron", torch.neuron.current_device()) if device_type == "neuron" \
        else torch.device("cpu")
    if device_type == "neuron":
        assert torch.neuron.current_device() == local
    for mode in modes:
        torch.manual_seed(0)
        model = Net().to(dev)
        dp_rank, dp_size = r, w
        if mode == "ddp":
            model = DDP(model)
        elif mode == "fsdp":
            mesh = init_device_mesh(device_type, (w,))
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif mode == "tp":
            mesh = init_device_mesh(device_type, (w,))
            parallelize_module(model, mesh, tp_plan())
            dp_rank, dp_size = 0, 1
        elif mode == "tp_fsdp":
            mesh2 = init_device_mesh(device_type, (2, w // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh2["tp"], tp_plan())
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh2["dp"])
            fully_shard(model, mesh=mesh2["dp"])
            dp_rank, dp_size = mesh2["dp"].get_local_rank(), 2
        step_fn = torch.compile(model, backend="neuron" if device_type == "neuron" else
                                "inductor", dynamic=False) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, grads = [], {}
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + dp_rank)
            x = torch.randn(BATCH // dp_size if mode == "tp_fsdp" else BATCH, SEQ, DIM,
                            generator=g).to(dev)
            y = torch.randn(x.shape, generator=g).to(dev)
            loss = F.mse_loss(step_fn(x), y)
            loss.backward()
            losses.append(float(loss.detach().cpu()))
            if step == STEPS - 1:
                grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {n: _full(p) for n, p in model.named_parameters()}
        torch.save({"loss": losses, "grads": grads, "params": params},
                   out / f"{mode}_{device_type}_{r}.pt")
        dist.barrier()
    dist.destroy_process_group()


# --- faults ------------------------------------------------------------------------------
def die(out: Path) -> None:
    dist.init_process_group(backend="neuron", timeout=timedelta(seconds=20))
    r = dist.get_rank()
    t = torch.ones(4, device="neuron")
    dist.all_reduce(t)
    if r == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(t)
        msg = "no error"
    except Exception as e:  # noqa: BLE001  (the test inspects the message)
        msg = f"{type(e).__name__}: {e}"
    (out / f"die_{r}.json").write_text(json.dumps({"error": msg,
                                                   "seconds": time.monotonic() - start}))
    os._exit(0)


def mismatch(out: Path) -> None:
    dist.init_process_group(backend="neuron")
    r = dist.get_rank()
    res = {}
    for name, t in (("shape", torch.ones(4 + r, device="neuron")),
                    ("dtype", torch.ones(4, device="neuron",
                                         dtype=torch.float32 if r else torch.int32))):
        try:
            dist.all_reduce(t)
            res[name] = "no error"
        except Exception as e:  # noqa: BLE001
            res[name] = f"{type(e).__name__}: {e}"
    (out / f"mismatch_{r}.json").write_text(json.dumps(res))
    # Tearing down gloo after a failed collective sometimes aborts the process ("terminate
    # called without an active exception", gloo's threads); exit without teardown.
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["collectives", "train", "die", "mismatch"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="neuron")
    p.add_argument("--backend", default="neuron")
    p.add_argument("--modes", default="ddp,fsdp,tp,tp_fsdp")
    p.add_argument("--compiled", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.job == "collectives":
        collectives(a.out)
    elif a.job == "train":
        train(a.out, a.device, a.backend, a.modes.split(","), a.compiled)
    elif a.job == "die":
        die(a.out)
    else:
        mismatch(a.out)
    sys.exit(0)


if __name__ == "__main__":
    main()
