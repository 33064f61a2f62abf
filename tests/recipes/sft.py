"""Recipe: TRL's SFTTrainer with torch_compile=True and every other TRL default
(gradient checkpointing on, bf16), on a tiny random Llama and an in-memory dataset.

    python sft.py MODEL_DIR --out losses.json [--cpu] [--no-compile]
"""

import argparse
import json
import tempfile

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--out", required=True)
p.add_argument("--cpu", action="store_true")
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()

texts = [f"the quick brown fox {i} jumps over the lazy dog {i % 7}" for i in range(32)]
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=4,
                 learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                 max_length=32, seed=0, use_cpu=a.cpu, torch_compile=not a.no_compile,
                 dataloader_num_workers=0, disable_tqdm=True)
trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(a.model), args=args,
                     train_dataset=Dataset.from_dict({"text": texts}),
                     processing_class=AutoTokenizer.from_pretrained(a.model))
trainer.train()
with open(a.out, "w") as f:
    json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
               "device": str(trainer.model.device)}, f)
