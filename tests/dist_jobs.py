"""torchrun jobs for tests/test_distributed.py: each writes per-rank results to --out.

`collectives`: every collective on neuron tensors (sync and async) against the expected
values, functional collectives eager and compiled. `contract`: TorchNeuron's process-group
details (name, sequence numbers, refusals) and SPMD cache keys. `train`: the validation pattern of
TorchNeuron: one job per (device, backend), DDP, FSDP2, TP (+ sequence
parallel) and TP x FSDP with activation checkpointing, dumping loss per step, grads and
parameters per rank for the test to compare (`--model llama`: a small HF Llama, sharded per
decoder layer; `--model mlp`: two linear layers). `sft`: TRL's SFTTrainer with
torch_compile=True. `syncbn`: nn.SyncBatchNorm under DDP. `die`: rank 1 exits mid-job.
`mismatch`: ranks pass different shapes. `exit`: DDP trains and returns.
"""

from __future__ import annotations

import argparse
import gc
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

DIM, HIDDEN, SEQ, BATCH, STEPS, VOCAB = 16, 32, 8, 4, 3, 256


# --- collectives -------------------------------------------------------------------------
class _Checks:
    """One rank's collective checks: results by name, and what every check needs."""

    def __init__(self) -> None:
        self.r, self.w = dist.get_rank(), dist.get_world_size()
        self.dev = torch.device("neuron", torch.neuron.current_device())
        self.ranks = torch.arange(self.w, dtype=torch.float32)
        self.res: dict[str, Any] = {"device": str(self.dev), "backend": dist.get_backend(),
                                    "visible": os.environ.get("NEURON_RT_VISIBLE_CORES")}

    def ok(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.res[name] = bool(got.device.type == "neuron"
                              and torch.allclose(got.cpu().float(), want.float(), atol=1e-5))

    def full(self, n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, device=self.dev)


def _all_reduce(c: _Checks) -> None:
    r, w, ranks = c.r, c.w, c.ranks
    for op, want in [(dist.ReduceOp.SUM, ranks.sum() + w), (dist.ReduceOp.PRODUCT,
                     (ranks + 1).prod()), (dist.ReduceOp.MIN, torch.tensor(1.)),
                     (dist.ReduceOp.MAX, torch.tensor(float(w)))]:
        for async_op in (False, True):
            t = c.full(5, float(r + 1))
            work = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                work.wait()
            c.ok(f"all_reduce_{op}_{'async' if async_op else 'sync'}", t, want.expand(5))
    for op, want in [(dist.ReduceOp.BAND, 0), (dist.ReduceOp.BOR, (1 << w) - 1),
                     (dist.ReduceOp.BXOR, (1 << w) - 1)]:
        t = torch.tensor([1 << r], device=c.dev, dtype=torch.int32)
        dist.all_reduce(t, op=op)
        c.ok(f"all_reduce_{op}", t, torch.tensor([want]))
    fut = dist.all_reduce(c.full(3, 1.0), async_op=True).get_future()
    c.res["future_is_neuron"] = fut.wait()[0].device.type == "neuron"
    rd = c.full(4, float(r + 1))
    dist.reduce(rd, dst=0)
    if r == 0:
        c.ok("reduce", rd, torch.full((4,), float(w * (w + 1) // 2)))


def _gather_scatter(c: _Checks) -> None:
    r, w, ranks, dev = c.r, c.w, c.ranks, c.dev
    x = torch.full((2, 3), float(r), device=dev)
    outs = [torch.empty(2, 3, device=dev) for _ in range(w)]
    dist.all_gather(outs, x)
    c.ok("all_gather", torch.stack(outs), ranks.view(w, 1, 1).expand(w, 2, 3))
    big = torch.empty(2 * w, 3, device=dev)
    dist.all_gather_into_tensor(big, x, async_op=True).wait()
    c.ok("all_gather_into_tensor", big, ranks.repeat_interleave(2).view(-1, 1).expand(-1, 3))
    flat = torch.empty(2 * w * 3, device=dev)  # NCCL semantics: only element counts must match
    dist.all_gather_into_tensor(flat, x)
    c.ok("all_gather_into_tensor_flat", flat, ranks.repeat_interleave(6).float())
    src = torch.arange(2 * w, dtype=torch.float32, device=dev) + r
    o = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(o, src)
    want_rs = (torch.arange(2 * w, dtype=torch.float32) * w + ranks.sum())[2 * r: 2 * r + 2]
    c.ok("reduce_scatter_tensor", o, want_rs)
    o2 = torch.empty(2, device=dev)
    dist.reduce_scatter(o2, list(src.chunk(w)))
    c.ok("reduce_scatter", o2, want_rs)
    b = c.full(4, float(r))
    dist.broadcast(b, src=w - 1)
    c.ok("broadcast", b, torch.full((4,), float(w - 1)))
    g = c.full(2, float(r))
    gl = [torch.empty(2, device=dev) for _ in range(w)] if r == 0 else None
    dist.gather(g, gl, dst=0)
    if r == 0 and gl is not None:
        c.ok("gather", torch.stack(gl), ranks.view(w, 1).expand(w, 2))
    sc = torch.empty(2, device=dev)
    dist.scatter(sc, [c.full(2, float(i)) for i in range(w)] if r == 0 else None, src=0)
    c.ok("scatter", sc, torch.full((2,), float(r)))


def _all_to_all(c: _Checks) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns this rank's input and the expected output, for the functional version."""
    r, w = c.r, c.w
    a_in = torch.arange(w * 2, dtype=torch.float32, device=c.dev) + 100 * r
    a_out = torch.empty_like(a_in)
    dist.all_to_all_single(a_out, a_in)
    want = torch.tensor([100. * s + 2 * r + k for s in range(w) for k in range(2)])
    c.ok("all_to_all_single", a_out, want)
    l_out = [torch.empty(2, device=c.dev) for _ in range(w)]
    dist.all_to_all(l_out, list(a_in.chunk(w)))
    c.ok("all_to_all", torch.cat(l_out), want)
    try:
        dist.all_to_all_single(a_out, a_in, [1] + [2] * (w - 2) + [3], [2] * w)
        c.res["uneven_error"] = ""
    except NotImplementedError as e:
        c.res["uneven_error"] = str(e)
    return a_in, want


def _point_to_point(c: _Checks) -> None:
    r, w = c.r, c.w
    dist.barrier()
    p2p = c.full(3, float(r))
    if r == 0:
        dist.send(p2p, dst=1)
    elif r == 1:
        dist.recv(p2p, src=0)
        c.ok("send_recv", p2p, torch.zeros(3))
    recv_buf = torch.empty(2, device=c.dev)
    ops = [dist.P2POp(dist.isend, c.full(2, float(r)), (r + 1) % w),
           dist.P2POp(dist.irecv, recv_buf, (r - 1) % w)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    c.ok("batch_isend_irecv", recv_buf, torch.full((2,), float((r - 1) % w)))


def _zero_copy(c: _Checks) -> None:
    """The bytes gloo wrote are the neuron tensor's bytes: no extra allocation."""
    z = torch.ones(1 << 16, device=c.dev)
    ptr = z.data_ptr()
    torch.neuron.reset_peak_memory_stats()
    before = torch.neuron.memory_allocated()
    dist.all_reduce(z)
    c.res["zero_copy"] = bool(z.data_ptr() == ptr
                              and torch.neuron.max_memory_allocated() == before)


def _functional(c: _Checks, a_in: torch.Tensor, want_a2a: torch.Tensor) -> None:
    """Functional collectives, eager and in a compiled graph."""
    import torch.distributed._functional_collectives as fc

    r, w, ranks, grp = c.r, c.w, c.ranks, dist.group.WORLD
    y = c.full(4, float(r + 1))
    c.ok("fc_all_reduce", fc.all_reduce(y, "sum", grp), torch.full((4,), float(w * (w + 1) / 2)))
    c.ok("fc_all_gather", fc.all_gather_tensor(y, 0, grp), (ranks + 1).repeat_interleave(4))
    rs = fc.reduce_scatter_tensor(torch.arange(4. * w, device=c.dev), "sum", 0, grp)
    c.ok("fc_reduce_scatter", rs, torch.arange(4. * w)[4 * r:4 * r + 4] * w)
    c.ok("fc_all_to_all", fc.all_to_all_single(a_in, None, None, grp), want_a2a)

    @torch.compile(backend="neuron", fullgraph=True)
    def f(v: torch.Tensor) -> torch.Tensor:
        s = fc.all_reduce(v * 2, "sum", grp)
        gathered = fc.all_gather_tensor(s + 1, 0, grp)
        return fc.reduce_scatter_tensor(gathered, "sum", 0, grp) + fc.all_to_all_single(
            gathered, None, None, grp).view(w, -1).sum(0)

    total = 2 * w * (w + 1) / 2 + 1
    c.ok("fc_compiled", f(y), torch.full((4,), total * w + total * w))


def collectives(out: Path) -> None:
    dist.init_process_group(backend="neuron")
    c = _Checks()
    _all_reduce(c)
    _gather_scatter(c)
    a_in, want_a2a = _all_to_all(c)
    _point_to_point(c)
    _zero_copy(c)
    _functional(c, a_in, want_a2a)
    dist.destroy_process_group()
    (out / f"collectives_{c.r}.json").write_text(json.dumps(c.res))


def _error(fn: Any) -> str:
    """`Type: message` of what fn raised, "" when it returned."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def contract(out: Path) -> None:
    """TorchNeuron's process-group contract on each rank: the group's name, Work sequence
    numbers, CPU tensors refused, uneven all_to_all_single refused eagerly and compiled,
    object collectives, and the cache keys of one compiled graph."""
    import torch.distributed._functional_collectives as fc

    from torch_neuronx.neuron_dynamo_backend.compile import (
        ArtifactType,
        clear_compiled_cache_keys,
        get_compiled_cache_keys,
    )

    dist.init_process_group(backend="neuron")
    r, w, pg = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dev = torch.device("neuron", torch.neuron.current_device())
    res: dict[str, Any] = {"name": pg.name()}
    works = [dist.all_reduce(torch.ones(2, device=dev), async_op=True) for _ in range(3)]
    res["seq"] = [x.get_sequence_number() for x in works]
    for x in works:
        x.wait()
    res["cpu_error"] = _error(lambda: dist.all_reduce(torch.ones(2)))
    splits = [1] * (w - 1) + [w + 1]  # 2w rows, uneven
    x = torch.arange(2. * w, device=dev)
    res["uneven_eager"] = _error(lambda: dist.all_to_all_single(torch.empty_like(x), x, splits,
                                                                splits))
    uneven = torch.compile(lambda v: fc.all_to_all_single(v, splits, splits, pg) + 1,
                           backend="neuron", fullgraph=True)
    res["uneven_compiled"] = _error(lambda: uneven(x))
    objs: list[Any] = [None] * w
    dist.all_gather_object(objs, {"rank": r})
    res["objects"] = objs
    torch._dynamo.reset()
    clear_compiled_cache_keys()
    torch.manual_seed(0)
    lin = nn.Linear(8, 4, bias=False).to(dev)
    # The graph creates a tensor on this rank's core, so its code names the core index.
    step = torch.compile(lambda v: lin(v) + torch.ones(4, device=dev), backend="neuron",
                         fullgraph=True)
    with torch.no_grad():
        step(torch.randn(2, 8, device=dev))
    res["keys"] = sorted(get_compiled_cache_keys(ArtifactType.NEURON_NEFF))
    dist.destroy_process_group()
    (out / f"contract_{r}.json").write_text(json.dumps(res))


def list_forms(out: Path) -> None:
    """TorchNeuron's list forms of the collectives on each rank, and clear errors for the
    lists they refuse (gloo would read past a short list or stop the process)."""
    dist.init_process_group(backend="neuron")
    r, w = dist.get_rank(), dist.get_world_size()
    dev = torch.device("neuron", torch.neuron.current_device())
    res: dict[str, Any] = {}
    base = torch.arange(12. * w).view(2 * w, 6)  # one tensor, scattered along dim 0 or 1
    want = base * w + sum(range(w))
    o = torch.empty(2, 6, device=dev)
    dist.reduce_scatter(o, [(base + r).to(dev)])
    res["rs_dim0"] = o.cpu().tolist() == want[2 * r: 2 * r + 2].tolist()
    wide = base.view(2, 6 * w)
    o = torch.empty(2, 6, device=dev)
    dist.reduce_scatter(o, [(wide + r).to(dev)])
    res["rs_dim1"] = o.cpu().tolist() == (wide * w + sum(range(w)))[:, 6 * r: 6 * r + 6].tolist()
    for name, call in [
        ("rs_wrong_size", lambda: dist.reduce_scatter(torch.ones(3, device=dev),
                                                      [torch.ones(8, device=dev)])),
        ("rs_empty_list", lambda: dist.reduce_scatter(torch.ones(2, device=dev), [])),
        ("rs_identical", lambda: dist.reduce_scatter(torch.ones(4, 4, device=dev),
                                                     [torch.ones(4, 4, device=dev)])),
        ("rs_empty", lambda: dist.reduce_scatter(torch.ones(2, device=dev),
                                                 [torch.ones(0, device=dev)] * w)),
        ("rs_list_size", lambda: dist.reduce_scatter(torch.ones(2, device=dev),
                                                     [torch.ones(2, device=dev)] * (w + 1))),
        ("a2a_short", lambda: dist.all_to_all([torch.zeros(3, device=dev)] * w,
                                              [torch.ones(3, device=dev)] * (w - 1))),
        ("a2a_long", lambda: dist.all_to_all([torch.zeros(3, device=dev)] * (w + 1),
                                             [torch.ones(3, device=dev)] * w)),
        ("ag_empty", lambda: dist.all_gather([torch.ones(0, device=dev)] * w,
                                             torch.ones(0, device=dev))),
        ("agc_empty", lambda: dist.all_gather_coalesced([[torch.ones(0, device=dev)] * w],
                                                        [torch.ones(0, device=dev)])),
    ]:
        res[name] = _error(call)
        dist.barrier()
    t = torch.full((3,), float(r + 1), device=dev)
    dist.reduce(t, dst=0)
    res["reduce"] = t.cpu().tolist()
    ins = [torch.full((2, 2), r + 1., device=dev), torch.full((3,), r + 5., device=dev)]
    outs = [[torch.zeros(2, 2, device=dev) for _ in range(w)],
            [torch.zeros(3, device=dev) for _ in range(w)]]
    dist.all_gather_coalesced(outs, ins)
    res["agc"] = [[float(t.mean()) for t in lst] for lst in outs]
    dist.destroy_process_group()
    (out / f"lists_{r}.json").write_text(json.dumps(res))


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


class MLP(nn.Module):
    """Two linear layers: the smallest colwise -> rowwise tensor-parallel pair."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


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


LLAMA_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                 "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                 "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def compiled_graphs(device: str) -> int:
    """Graphs compiled in this process: the neuron backend's records, or AOTAutograd's count
    of Inductor's compiles on CPU."""
    if str(device).startswith("neuron"):
        return torch.neuron.get_dynamo_metrics()["num_graphs"]
    return torch._dynamo.utils.counters["aot_autograd"]["total"]


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # 1.6 MB of parameters: DDP (1 MB buckets) gets two buckets, so compiled DDP splits the
    # graph; 4 heads of each kind shard over 2 or 4 TP ranks.
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)  # use_cache left at its default (True)
    return LlamaForCausalLM(cfg)


def shard(model: nn.Module, kind: str, mode: str, device_type: str, w: int) -> tuple[int, int]:
    """Applies `mode` to `model` in place; returns (data-parallel rank, data-parallel size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    blocks = {"net": lambda: model.blocks, "llama": lambda: model.model.layers,
              "mlp": lambda: []}[kind]()

    def tensor_parallel(tp_mesh: Any) -> None:
        if kind == "net":
            parallelize_module(model, tp_mesh, tp_plan())
            return
        if kind == "mlp":
            parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            return
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in blocks:
            parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in LLAMA_TP_PLAN.items()})

    if mode == "tp":
        tensor_parallel(init_device_mesh(device_type, (w,)))
        return 0, 1
    if mode == "fsdp":
        mesh = init_device_mesh(device_type, (w,))
        for blk in blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return dist.get_rank(), w
    mesh2 = init_device_mesh(device_type, (2, w // 2), mesh_dim_names=("dp", "tp"))
    tensor_parallel(mesh2["tp"])
    for blk in blocks:
        fully_shard(blk, mesh=mesh2["dp"])
    fully_shard(model, mesh=mesh2["dp"])
    return mesh2["dp"].get_local_rank(), 2


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def batch(kind: str, step: int, dp_rank: int, rows: int, dev: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    if kind == "llama":
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g).to(dev)
        return ids, ids
    x = torch.randn(rows, SEQ, DIM, generator=g)
    return x.to(dev), torch.randn(x.shape, generator=g).to(dev)


def divide_gradients_by(model: nn.Module, factor: float, device_type: str) -> None:
    """FSDP2's gradient divide factor (torchtitan sets 1.0): on neuron, reduce-scatters with
    ReduceOp.PREMUL_SUM as on NCCL; gloo has no PREMUL_SUM, so the CPU reference sums and
    divides after (the same numbers for a factor of 1 or a power of 2)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(factor)
            if device_type == "cpu":
                m.set_force_sum_reduction_for_comms(True)


def train(out: Path, device_type: str, backend: str, modes: list[str], compiled: bool,
          kind: str, divide: float | None = None) -> None:
    from torch.distributed.tensor import DTensor
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
        model = {"net": Net, "llama": llama, "mlp": MLP}[kind]().to(dev)
        if mode == "ddp":
            model, dp_rank, dp_size = DDP(model, bucket_cap_mb=1), r, w
        else:
            dp_rank, dp_size = shard(model, kind, mode, device_type, w)
            if divide is not None:
                divide_gradients_by(model, divide, device_type)
        torch._dynamo.reset()
        step_fn = torch.compile(model, backend="neuron" if device_type == "neuron" else
                                "inductor", dynamic=False) if compiled else model
        # DTensor's foreach ops reject a list mixing DTensors and plain tensors (TP of the
        # decoder layers only): as on CUDA, such a model steps with the per-tensor path,
        # which is also CPU's default.
        mixed = len({isinstance(p, DTensor) for p in model.parameters()}) > 1
        opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False if mixed else None)
        losses, grads = [], {}
        for step in range(STEPS):
            x, y = batch(kind, step, dp_rank, BATCH // dp_size if mode == "tp_fsdp" else BATCH,
                         dev)
            loss = step_fn(input_ids=x, labels=y).loss if kind == "llama" else \
                F.mse_loss(step_fn(x), y)
            loss.backward()
            losses.append(float(loss.detach().cpu()))
            if step == STEPS - 1:
                grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {n: _full(p) for n, p in model.named_parameters()}
        graphs = compiled_graphs(dev)
        torch.save({"loss": losses, "grads": grads, "params": params, "graphs": graphs},
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
    dist.destroy_process_group()  # a survivor tears down and exits 0 (the test checks)


def pg_timeout(out: Path) -> None:
    """`_set_pg_timeout` to 2 s on a 60 s group; rank 1 stays away: rank 0's all_reduce
    fails within the new timeout, naming it."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.init_process_group(backend="neuron", timeout=timedelta(seconds=60))
    _set_pg_timeout(timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(12)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4, device="neuron"))
        msg = "no error"
    except Exception as e:  # noqa: BLE001  (the test inspects the message)
        msg = f"{type(e).__name__}: {e}"
    (out / "pg_timeout_0.json").write_text(json.dumps({"error": msg,
                                                       "seconds": time.monotonic() - start}))
    os._exit(0)


def mismatch(out: Path) -> None:
    """Rank r all-reduces 4 + r elements, then (with the checks on) a different dtype."""
    dist.init_process_group(backend="neuron")
    r = dist.get_rank()
    res = {}
    cases = [("shape", torch.ones(4 + r, device="neuron"))]
    if os.environ.get("NEURONLOCAL_DIST_CHECKS") == "1":  # without checks gloo cannot go on
        cases.append(("dtype", torch.ones(4, device="neuron",
                                          dtype=torch.float32 if r else torch.int32)))
    for name, t in cases:
        try:
            dist.all_reduce(t)
            res[name] = "no error"
        except Exception as e:  # noqa: BLE001
            res[name] = f"{type(e).__name__}: {e}"
    (out / f"mismatch_{r}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def exit_after_training(out: Path) -> None:
    """DDP trains, the group is destroyed, the script returns: the exit status must be 0."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="neuron")
    model = DDP(Net(ac=False).to("neuron"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = batch("net", step, dist.get_rank(), BATCH, torch.device("neuron"))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def sync_batch_norm(out: Path) -> None:
    """nn.SyncBatchNorm under DDP on neuron: each rank normalises its half of one batch with
    the statistics of the whole batch, so its outputs, input gradients and running statistics
    equal a plain BatchNorm over the whole batch on CPU; then a few training steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="neuron")
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x_all, g_all = torch.randn(4 * w, 3, 5, 5), torch.randn(4 * w, 3, 5, 5)
    ref = nn.BatchNorm2d(3)
    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g_all).sum().backward()
    mine = slice(4 * r, 4 * (r + 1))
    model = DDP(nn.SyncBatchNorm(3).to("neuron"))
    x = x_all[mine].to("neuron").requires_grad_()
    y = model(x)
    (y * g_all[mine].to("neuron")).sum().backward()
    bn = model.module
    res: dict[str, Any] = {
        "out": torch.allclose(y.detach().cpu(), y_ref[mine].detach(), atol=1e-5),
        "grad_input": torch.allclose(x.grad.cpu(), x_ref.grad[mine], atol=1e-4),
        "running_mean": torch.allclose(bn.running_mean.cpu(), ref.running_mean, atol=1e-5),
        "running_var": torch.allclose(bn.running_var.cpu(), ref.running_var, atol=1e-5),
        "grad_weight": torch.allclose(bn.weight.grad.cpu(), ref.weight.grad / w, atol=1e-4),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (model(x_all[mine].to("neuron")) * g_all[mine].to("neuron")).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    res["losses"] = losses
    (out / f"syncbn_{r}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def sft(out: Path, device_type: str, backend: str, compiled: bool) -> None:
    """TRL's SFTTrainer (torch_compile=`compiled`) on every rank, DDP through accelerate. SGD,
    so parameter differences track gradient differences (Adam's first steps are sign-like)."""
    import tempfile

    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    texts = [f"the quick brown fox {i} jumps over the lazy dog {i * 7 % 13}" for i in range(64)]
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(texts, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<eos>")
    dist.init_process_group(backend=backend)
    r = dist.get_rank()
    path = out / f"sft_model_{device_type}"
    if r == 0:
        torch.manual_seed(0)
        llama().save_pretrained(path)
    dist.barrier()
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=3,
                     learning_rate=1e-3, logging_steps=1, report_to=[], packing=True,
                     max_length=16, save_strategy="no", seed=0, dataloader_num_workers=0,
                     disable_tqdm=True, use_cpu=device_type == "cpu", torch_compile=compiled,
                     optim="sgd", pad_to_multiple_of=16,  # TRL pads to 128 on neuron only
                     torch_compile_backend="neuron" if device_type == "neuron" else "inductor")
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(path), args=args,
                         train_dataset=Dataset.from_dict({"text": texts}), processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    graphs = compiled_graphs(device_type)
    torch.save({"loss": losses, "params": params, "grads": {}, "graphs": graphs},
               out / f"sft_{device_type}_{r}.pt")
    # The DDP reducer holds the process group: released on every rank, after a barrier, before
    # the group goes (gloo's destructor joins its worker threads, and a rank that freed its
    # reducer while the other still ran left one of them waiting: a rank hung at exit).
    del trainer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["collectives", "contract", "lists", "train", "die",
                                   "mismatch", "exit", "sft", "syncbn", "pg_timeout"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="neuron")
    p.add_argument("--backend", default="neuron")
    p.add_argument("--modes", default="ddp,fsdp,tp,tp_fsdp")
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--model", choices=["net", "llama", "mlp"], default="net")
    p.add_argument("--divide", type=float, default=None, help="FSDP2 gradient divide factor")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.job == "collectives":
        collectives(a.out)
    elif a.job == "contract":
        contract(a.out)
    elif a.job == "lists":
        list_forms(a.out)
    elif a.job == "train":
        train(a.out, a.device, a.backend, a.modes.split(","), a.compiled, a.model, a.divide)
    elif a.job == "die":
        die(a.out)
    elif a.job == "exit":
        exit_after_training(a.out)
    elif a.job == "sft":
        sft(a.out, a.device, a.backend, a.compiled)
    elif a.job == "syncbn":
        sync_batch_norm(a.out)
    elif a.job == "pg_timeout":
        pg_timeout(a.out)
    else:
        mismatch(a.out)
    sys.exit(0)


if __name__ == "__main__":
    main()
