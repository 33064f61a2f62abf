"""FlexAttention on neuron against FlexAttention on CPU, each side in its own process.

torchtitan's default attention at its default sizes: batch 8 x 16 heads x 2048 positions x
head dim 16 (its llama3 debug model), causal block mask, compiled, forward only (CPU's
FlexAttention has no backward). The neuron side runs the blockwise operator
(compile/flex.py); CPU runs Inductor's fused FlexAttention kernel. Prints the time ratio
neuron / CPU (no goal: the ratio is what is stated) and neuron's peak HBM next to one
fp32 seq x seq score matrix of all heads.
Run: python bench/flex.py [--rounds N] [--quick]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, run_cases  # noqa: E402


def forward_setup(side: str, batch: int, heads: int, seq: int, dim: int) -> Callable[[], object]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim).to(side) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, batch, None, seq, seq, device=side)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask))

    shown = []

    def run() -> None:
        with torch.no_grad():
            fn(q, k, v)
        if side == "neuron" and not shown:
            shown.append(True)
            dense = batch * heads * seq * seq * 4
            peak = torch.neuron.max_memory_allocated() - 3 * q.nbytes
            print(f"neuron peak HBM above the inputs {peak / 2**20:.0f} MiB "
                  f"(one dense fp32 score matrix: {dense / 2**20:.0f} MiB)", file=sys.stderr)

    return run


def cases(quick: bool) -> list[Case]:
    size = {"batch": 2, "heads": 16, "seq": 1024, "dim": 16} if quick else \
        {"batch": 8, "heads": 16, "seq": 2048, "dim": 16}
    return [Case("flex forward, causal, torchtitan debug sizes", forward_setup, size,
                 sides=("cpu", "neuron"))]


if __name__ == "__main__":
    run_cases(__file__, cases, title="flex attention: time ratio neuron / cpu",
              description=__doc__)
