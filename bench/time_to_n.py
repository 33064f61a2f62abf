"""Time to N steps: process start to the end of step N, compiles included, per compiler.

The mid-size Llama (hidden 512 x 4 layers, batch 2 x 128), forward + loss + backward + SGD,
each side in its own process with empty compile caches, the sides alternated per round;
medians over rounds with the min-max spread. Sides: plain CPU eager, stock Inductor on CPU,
neuron with the default compiler, neuron with the tiered compiler (its switch call as
NEURONLOCAL_TIER_SWITCH says, default 300).

Goals (printed beside the table): at N = 1000 the tiered compiler takes at most 1.05x the
better of CPU eager and stock Inductor; at N = 10 and 100 at most CPU eager's time + 2.5 s.
Run: python bench/time_to_n.py [--rounds R] [--steps 10,100,1000] [--sides a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("cpu-eager", "cpu-inductor", "neuron", "neuron-tiered")
_CHILD = """
import os, sys, time, json
sys.path.insert(0, {bench!r})
import torch
from _common import llama
side, steps = {side!r}, {steps!r}
device = "cpu" if side.startswith("cpu") else "neuron"
model = llama(512, 4).train().to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
fn = lambda x: model(x, labels=x).loss
if side != "cpu-eager":
    fn = torch.compile(fn, backend="inductor" if side == "cpu-inductor" else "neuron")
x = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
marks = {{}}
for i in range(1, max(steps) + 1):
    fn(x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i in steps:
        marks[i] = time.time()
print("TIME_TO_N " + json.dumps(marks))
"""


def _one(side: str, steps: list[int]) -> dict[int, float]:
    with tempfile.TemporaryDirectory(prefix="neuronlocal-ttn-") as d:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor",
               "TORCH_NEURONX_NEFF_CACHE_DIR": f"{d}/neff",
               "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": f"{d}/locks",
               "NEURONLOCAL_COMPILER": "tiered" if side == "neuron-tiered" else "eager"}
        code = _CHILD.format(bench=str(Path(__file__).parent), side=side, steps=steps)
        start = time.time()
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("TIME_TO_N "))
    return {int(k): v - start for k, v in json.loads(line[len("TIME_TO_N "):]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", default="10,100,1000")
    p.add_argument("--sides", default=",".join(SIDES))
    args = p.parse_args()
    steps = sorted(int(s) for s in args.steps.split(","))
    sides = args.sides.split(",")
    runs: dict[str, list[dict[int, float]]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            runs[side].append(_one(side, steps))
            print(f"round {r + 1}/{args.rounds} {side}: "
                  + ", ".join(f"N={n} {t:.1f}s" for n, t in runs[side][-1].items()),
                  file=sys.stderr, flush=True)
    med = {s: {n: statistics.median(x[n] for x in runs[s]) for n in steps} for s in sides}
    print(f"time to N steps (s), median of {args.rounds} rounds [min-max]")
    print(f"{'side':<16}" + "".join(f"{'N=' + str(n):>22}" for n in steps))
    for s in sides:
        cells = [f"{med[s][n]:.1f} [{min(x[n] for x in runs[s]):.1f}-"
                 f"{max(x[n] for x in runs[s]):.1f}]" for n in steps]
        print(f"{s:<16}" + "".join(f"{c:>22}" for c in cells))
    if {"cpu-eager", "cpu-inductor", "neuron-tiered"} <= set(sides):
        for n in steps:
            tiered, eager = med["neuron-tiered"][n], med["cpu-eager"][n]
            best = min(eager, med["cpu-inductor"][n])
            goal = (f"<= 1.05x best peer: {tiered / best:.2f}x" if n >= 1000 else
                    f"<= CPU eager + 2.5 s: {tiered - eager:+.1f} s")
            print(f"N={n}: tiered {goal}")


if __name__ == "__main__":
    main()
