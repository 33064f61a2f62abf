"""TRL's stock SFTTrainer on neuron, with the settings TorchNeuron documents, and a CPU reference.

Settings from the TorchNeuron blog / TRL PR #5125: static shapes for Dynamo
(`automatic_dynamic_shapes = False`) and `HF_DEACTIVATE_ASYNC_LOAD=1`. A tiny random Llama and a
word-level tokenizer built here (no downloads), packing on.

    python examples/sft_trl.py                      # one process on neuron:0, then on CPU, compare
    torchrun --nproc_per_node 4 examples/sft_trl.py --tp 2 --fsdp 2   # TP=2 x FSDP=2
Prints one line `losses <device> [...]` per run; `--json FILE` writes them too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")

import torch  # noqa: E402

torch._dynamo.config.automatic_dynamic_shapes = False

TEXTS = [f"the quick brown fox {i} jumps over the lazy dog {i * 7 % 13} and runs {i % 5}"
         for i in range(96)]


def tokenizer():  # type: ignore[no-untyped-def]
    """A word-level tokenizer trained on TEXTS (stands in for a Hub tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>",
                                                                           "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")


def save_model(path: str, vocab: int, pad: int, eos: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, pad_token_id=pad, eos_token_id=eos)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def train(path: str, tok, use_cpu: bool, steps: int, batch: int, tp: int, fsdp: int  # type: ignore[no-untyped-def]
          ) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    kwargs = {}
    if tp * fsdp > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=tp, fsdp_size=fsdp)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                     max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
                     use_cpu=use_cpu, packing=True, max_length=32, save_strategy="no", seed=0,
                     train_sampling_strategy="sequential", dataloader_num_workers=0,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                         processing_class=tok)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="global batch (split over FSDP ranks)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=1)
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU reference run")
    p.add_argument("--json")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp * args.fsdp != world:
        raise SystemExit(f"--tp {args.tp} x --fsdp {args.fsdp} must equal the number of "
                         f"processes ({world}); launch with torchrun --nproc_per_node "
                         f"{args.tp * args.fsdp}.")
    if args.batch % args.fsdp:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --fsdp {args.fsdp}.")
    rank = int(os.environ.get("RANK", "0"))
    tok = tokenizer()
    path = model_dir(world, rank, tok)
    try:
        result = {"neuron": train(path, tok, False, args.steps, args.batch // args.fsdp,
                                  args.tp, args.fsdp)}
        if rank == 0:
            print("losses neuron", result["neuron"], flush=True)
            if not args.no_cpu and world == 1:
                result["cpu"] = train(path, tok, True, args.steps, args.batch, 1, 1)
                print("losses cpu", result["cpu"], flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.barrier()  # every rank has loaded the model before it goes
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def model_dir(world: int, rank: int, tok) -> str:  # type: ignore[no-untyped-def]
    """The tiny model, saved once where every rank reads it: a fresh private folder that rank
    0 makes (`mkdtemp`: mode 0700, a name nobody can have made beforehand, never a shared
    predictable path in /tmp) and whose name it sends to the other ranks."""
    path = ""
    if rank == 0:
        path = tempfile.mkdtemp(prefix="neuronlocal_sft_tiny_")
        save_model(path, len(tok), tok.pad_token_id, tok.eos_token_id)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("neuron")
        names = [path]
        dist.broadcast_object_list(names, src=0)
        path = names[0]
    return path


if __name__ == "__main__":
    main()
