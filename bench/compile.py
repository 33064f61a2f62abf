"""Compiled cost: neuron / stock Inductor on plain CPU, each side in its own process.

- warm restart: the first compiled forward+backward step of a tiny Llama (hidden 128,
  2 layers, batch 2x32) in a new process whose compile caches are warm (both sides primed
  once into one private temporary cache folder first). Dynamo tracing, cache lookups,
  loading the compiled code and the step itself all count. Goal: <= 1.2.
- steady step: a compiled forward+backward step of Llama hidden 512, 4 layers, batch
  2x128, after warm-up. Goal: <= 1.05.
Afterwards, in new processes: a cold compile, then a warm one, of the warm-restart step
with neuron, with their cache states (a hit must never cost more than a miss).
Run: python bench/compile.py [--quick] [--rounds N]   (--quick: steady step hidden 256)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, Goal, llama, run_cases  # noqa: E402


def step_setup(side: str, hidden: int, layers: int, batch: int, seq: int
               ) -> Callable[[], object]:
    """One compiled training step (forward, loss, backward) on `side`; built per process."""
    import torch

    model = llama(hidden, layers).train().to(side)
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(side)
    backend = "neuron" if side == "neuron" else "inductor"
    fn = torch.compile(lambda x: model(x, labels=x).loss, backend=backend)

    def run() -> None:
        fn(ids).backward()
        model.zero_grad(set_to_none=True)

    return run


WARM = {"hidden": 128, "layers": 2, "batch": 2, "seq": 32}


def cases(quick: bool) -> list[Case]:
    steady = {"hidden": 256, "layers": 4, "batch": 2, "seq": 64} if quick else \
        {"hidden": 512, "layers": 4, "batch": 2, "seq": 128}
    return [
        Case("warm restart: first compiled step in a new process", step_setup, WARM,
             Goal("<=", 1.2), repeat=1, warmup=0, prime=True),
        Case(f"steady compiled step, hidden {steady['hidden']}", step_setup, steady,
             Goal("<=", 1.05), prime=True),
    ]


_PROC = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from compile import WARM, step_setup
run = step_setup("neuron", **WARM)
t = time.perf_counter()
run()
wall = time.perf_counter() - t
m = torch.neuron.get_dynamo_metrics()
print(json.dumps({{"wall": wall, "cache": [g["cache"] for g in m["graphs"]]}}))
"""


def cold_vs_warm(args: Any) -> dict[str, Any]:
    """First neuron step with an empty cache, then with the cache that run filled."""
    code = _PROC.format(bench=str(Path(__file__).parent))
    runs = []
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": f"{d}/neff",
               "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": f"{d}/locks",
               "TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor"}
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    cold, warm = runs
    print(f"neuron first step: cold cache {cold['wall']:.2f}s ({cold['cache']}), warm cache "
          f"{warm['wall']:.2f}s ({warm['cache']}): warm/cold {warm['wall'] / cold['wall']:.2f}")
    return {"cold_first_step_s": cold["wall"], "warm_first_step_s": warm["wall"],
            "cold_cache": cold["cache"], "warm_cache": warm["cache"]}


def main() -> None:
    # One private cache folder for both sides and every process of this run, so each
    # process after the priming one starts warm, as a restarted job does.
    with tempfile.TemporaryDirectory(prefix="neuronlocal-bench-") as d:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{d}/inductor")
        os.environ.setdefault("TORCH_NEURONX_NEFF_CACHE_DIR", f"{d}/neff")
        os.environ.setdefault("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", f"{d}/locks")
        run_cases(__file__, cases, title="compile: time ratio neuron / Inductor on CPU",
                  description=__doc__, extra=cold_vs_warm)


if __name__ == "__main__":
    main()
