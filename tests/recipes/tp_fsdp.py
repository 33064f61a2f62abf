"""Recipe: tensor parallel x FSDP2 on 4 ranks, compiled with the default torch.compile, the HF
model left at its defaults (use_cache=True).

    torchrun --nproc-per-node 4 tp_fsdp.py MODEL_DIR --device neuron --out DIR [--no-compile]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--device", default="neuron")
p.add_argument("--out", required=True)
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()

dist.init_process_group(backend="neuron" if a.device == "neuron" else "gloo")
model = AutoModelForCausalLM.from_pretrained(a.model).to(a.device)
mesh = init_device_mesh(a.device, (2, 2), mesh_dim_names=("dp", "tp"))
plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel()}
for layer in model.model.layers:
    parallelize_module(layer, mesh["tp"], plan)
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
step = model if a.no_compile else torch.compile(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for i in range(2):
    g = torch.Generator().manual_seed(100 * i + mesh["dp"].get_local_rank())
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(a.device)
    loss = step(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
norm = sum(p.full_tensor().float().norm() ** 2 for p in model.parameters()) ** 0.5
rank = dist.get_rank()
Path(a.out, f"rank{rank}.json").write_text(json.dumps({"losses": losses,
                                                       "param_norm": norm.item()}))
dist.destroy_process_group()
