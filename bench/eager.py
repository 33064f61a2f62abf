"""Eager mode cost: neuron / plain CPU, each side in its own process (see _common.py).

(a) tiny Llama forward (hidden 256, 4 layers, batch 2x64):                 goal <= 1.05
(b) Llama forward (hidden 1024, 8 layers, batch 4x256):                    goal <= 1.05
(c) training step of (a): forward, backward, AdamW (default: foreach):     goal <= 1.15
(d) training step, Llama hidden 512, 4 layers, batch 4x128:                goal <= 1.03
Run: python bench/eager.py [--quick] [--rounds N] [--only train]   (--quick: (a) and (c))
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, Goal, llama, run_cases  # noqa: E402


def forward(side: str, hidden: int, layers: int, batch: int, seq: int) -> Callable[[], object]:
    import torch

    model = llama(hidden, layers).to(side)
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(side)

    def run() -> object:
        with torch.no_grad():
            return model(ids).logits

    return run


def train_step(side: str, hidden: int, layers: int, batch: int, seq: int
               ) -> Callable[[], object]:
    import torch

    model = llama(hidden, layers).train().to(side)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the default a user gets
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(side)
    sync = torch.neuron.synchronize if side == "neuron" else (lambda: None)

    def run() -> None:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()  # the optimizer's queued foreach run belongs to this step

    return run


def cases(quick: bool) -> list[Case]:
    tiny = {"hidden": 256, "layers": 4, "batch": 2, "seq": 64}
    out = [Case("(a) tiny Llama forward", forward, tiny, Goal("<=", 1.05))]
    if not quick:
        out.append(Case("(b) Llama-1024x8 forward 4x256", forward,
                        {"hidden": 1024, "layers": 8, "batch": 4, "seq": 256}, Goal("<=", 1.05)))
    out.append(Case("(c) tiny Llama train step", train_step, tiny, Goal("<=", 1.15)))
    if not quick:
        out.append(Case("(d) Llama-512x4 train step 4x128", train_step,
                        {"hidden": 512, "layers": 4, "batch": 4, "seq": 128}, Goal("<=", 1.03)))
    return out


if __name__ == "__main__":
    run_cases(__file__, cases, title="eager: neuron / cpu", description=__doc__)
