"""Recipe: inference on one core with `device_map`, a static KV cache and a compiled forward.

    python generate_static.py MODEL_DIR --device neuron --out tokens.json [--no-compile]

As the announcement writes it: load with device_map, compile the forward with the default
torch.compile (no backend named), generate greedily with cache_implementation="static".
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--device", default="neuron")
p.add_argument("--out", required=True)
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()

model = AutoModelForCausalLM.from_pretrained(a.model, device_map=a.device)
if not a.no_compile:
    model.forward = torch.compile(model.forward)
tokens = []
for length in (5, 9):
    ids = torch.randint(3, model.config.vocab_size, (1, length),
                        generator=torch.Generator().manual_seed(length))
    out = model.generate(ids.to(a.device), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         cache_implementation="static")
    tokens.append(out[0].tolist())
with open(a.out, "w") as f:
    json.dump({"tokens": tokens}, f)
