"""Eager mode cost: neuron / plain CPU, measured in the same run (issue 2 goals).

(a) tiny Llama forward (4 layers, hidden 256, batch 2x64): goal <= 1.5
(b) Llama forward (8 layers, hidden 1024, batch 4x256):     goal <= 1.1
(c) one training step of (a) (forward, backward, AdamW):    reported
Run: python bench/eager.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_of, llama  # noqa: E402


def forward_ratio(
    hidden: int, layers: int, batch: int, seq: int, repeat: int
) -> tuple[float, float]:
    cpu = llama(hidden, layers)
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 1000, (batch, seq))
    ids_dev = ids.to("neuron")
    with torch.no_grad():
        t_cpu = best_of(lambda: cpu(ids).logits, repeat)
        t_dev = best_of(lambda: dev(ids_dev).logits, repeat)
    return t_cpu, t_dev


def train_ratio(repeat: int) -> tuple[float, float]:
    def step_fn(model: torch.nn.Module, ids: torch.Tensor):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    cpu = llama(256, 4).train()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 1000, (2, 64))
    t_cpu = best_of(step_fn(cpu, ids), repeat)
    t_dev = best_of(step_fn(dev, ids.to("neuron")), repeat)
    return t_cpu, t_dev


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="skip the large model")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    rows = [("(a) tiny Llama forward", *forward_ratio(256, 4, 2, 64, args.repeat), 1.5)]
    if not args.quick:
        rows.append(("(b) Llama-1024x8 forward", *forward_ratio(1024, 8, 4, 256, 3), 1.1))
    rows.append(("(c) tiny Llama train step", *train_ratio(args.repeat), None))
    print(f"{'case':<28}{'cpu ms':>10}{'neuron ms':>11}{'ratio':>8}{'goal':>8}")
    for name, t_cpu, t_dev, goal in rows:
        g = f"<={goal}" if goal else "-"
        print(f"{name:<28}{t_cpu * 1e3:>10.2f}{t_dev * 1e3:>11.2f}{t_dev / t_cpu:>8.2f}{g:>8}")


if __name__ == "__main__":
    main()
