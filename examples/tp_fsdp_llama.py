"""TP=2 x FSDP=2 on 4 ranks: a small Llama trained on neuron with the `neuron` backend.

    torchrun --nproc-per-node 4 examples/tp_fsdp_llama.py [--steps 5] [--compile]

Tensor parallelism (DTensor Colwise/Rowwise over the attention and MLP projections) runs
inside each pair of ranks, FSDP2 (`fully_shard`) across the pairs, with activation
checkpointing on every decoder layer. Swap `--device cpu` to run the same job on gloo.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="neuron")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()

    dist.init_process_group(backend="neuron" if a.device == "neuron" else "gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh(a.device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(a.device)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    step = torch.compile(model, backend="neuron") if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = mesh["dp"].get_local_rank()
    for i in range(a.steps):
        g = torch.Generator().manual_seed(1000 * i + dp_rank)  # same batch within a TP pair
        ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g).to(a.device)
        loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {i} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
