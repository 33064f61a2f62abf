"""LoRA (PEFT) on a tiny Llama on neuron: a few AdamW steps, merge, compare with a CPU run.

    python examples/lora_peft.py [--steps 4]
"""

from __future__ import annotations

import argparse

import torch


def run(device: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights="gaussian", lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(cfg), lora).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (4, 24), generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    merged = model.merge_and_unload()
    return losses, {k: v.detach().cpu() for k, v in merged.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    lc, wc = run("cpu", args.steps)
    ln, wn = run("neuron", args.steps)
    diff = max((wc[k] - wn[k]).abs().max().item() for k in wc)
    print("losses cpu   ", [round(x, 6) for x in lc])
    print("losses neuron", [round(x, 6) for x in ln])
    print(f"merged weights: max |neuron - cpu| = {diff:.2e}")
    if diff > 1e-4 or max(abs(a - b) for a, b in zip(lc, ln, strict=True)) > 1e-4:
        raise SystemExit("neuron and CPU LoRA runs differ")


if __name__ == "__main__":
    main()
