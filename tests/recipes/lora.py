"""Recipe: PEFT LoRA fine-tuning on neuron (adapters on q/v, a few AdamW steps).

    python lora.py MODEL_DIR --device neuron --out losses.json
"""

import argparse
import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--device", default="neuron")
p.add_argument("--out", required=True)
a = p.parse_args()

torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(a.model),
                       LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                  lora_dropout=0.0, task_type="CAUSAL_LM")).to(a.device)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
losses = []
for i in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(i)).to(a.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
with open(a.out, "w") as f:
    json.dump({"losses": losses, "trainable": model.get_nb_trainable_parameters()[0]}, f)
