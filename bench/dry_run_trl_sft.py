"""TRL's SFTTrainer on a Llama-3.1-8B-shaped model under FSDP2, for `neuronlocal run --dry-run`.

The model comes from a config dict (no download): built on `meta`, each decoder layer and
the root sharded with FSDP2 over every rank (fp32 shards, bf16 compute, fp32 gradient
reduction), materialised on the device shard by shard (`to_empty`, then the model's own
`init_weights`), and handed to TRL's stock SFTTrainer with a tiny in-memory dataset (long
texts, so every example fills `--seq` tokens) and a word-level tokenizer trained here. The
trainer is told the model is FSDP2 (`fsdp_config` version 2): accelerate keeps an already
sharded model as it is. TRL's default gradient checkpointing stays on.

    neuronlocal run --dry-run --instance trn2.48xlarge --nproc-per-node 64 \
        bench/dry_run_trl_sft.py

`--layers`, `--hidden`, `--ffn`, `--heads`, `--kv`, `--vocab` and `--seq` shrink it (a test
runs it at 2 layers). Run for real it needs the hardware (32 GB of fp32 weights).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Llama-3.1-8B's config.json, as a dict.
LLAMA_31_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False}
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps".split()


def tokenizer() -> Any:
    """A word-level tokenizer trained on WORDS (stands in for Llama's, downloaded from a hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")


def sharded_model(cfg: Any) -> Any:
    """The model on `meta`, FSDP2 per decoder layer and at the root, then materialised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="neuron")
    with torch.no_grad():
        model.init_weights()
        rope = LlamaRotaryEmbedding(cfg)  # the RoPE buffers, computed on the host
        for name, buf in rope.named_buffers():
            getattr(model.model.rotary_emb, name).copy_(buf)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    for name, key in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                      ("ffn", "intermediate_size"), ("heads", "num_attention_heads"),
                      ("kv", "num_key_value_heads"), ("vocab", "vocab_size")):
        p.add_argument(f"--{name}", type=int, default=LLAMA_31_8B[key])
    p.add_argument("--seq", type=int, default=2048, help="tokens per example (max_length)")
    p.add_argument("--batch", type=int, default=1, help="examples per rank per step")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    from datasets import Dataset
    from transformers import LlamaConfig
    from trl import SFTConfig, SFTTrainer

    dist.init_process_group("neuron")
    t0 = time.time()
    tok = tokenizer()
    cfg = LlamaConfig(**{**LLAMA_31_8B, "num_hidden_layers": a.layers, "hidden_size": a.hidden,
                         "intermediate_size": a.ffn, "num_attention_heads": a.heads,
                         "num_key_value_heads": a.kv, "vocab_size": a.vocab,
                         "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                         "bos_token_id": None})
    model = sharded_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    world = dist.get_world_size()
    # every rank's examples for every step, each longer than --seq words
    text = " ".join(WORDS[i % len(WORDS)] for i in range(a.seq + 16))
    data = Dataset.from_dict({"text": [text] * (world * a.batch * (a.steps + 1))})
    args = SFTConfig(output_dir=tempfile.mkdtemp(prefix="dry_sft_"), max_steps=a.steps,
                     per_device_train_batch_size=a.batch, max_length=a.seq, packing=False,
                     learning_rate=1e-5, optim="adamw_torch", logging_steps=1, report_to=[],
                     save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
                     fsdp="full_shard", fsdp_config={"fsdp_version": 2,
                                                     "reshard_after_forward": True})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"rank {dist.get_rank()}: {n / 1e9:.2f}B params (sharded over {world}), "
          f"peak HBM {torch.neuron.max_memory_allocated() / 2**30:.2f} GiB, host peak RSS "
          f"{rss:.2f} GiB, {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
