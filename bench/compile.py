"""Compiled cost, each side in its own process, alternated (medians and spread over rounds).

Tiny HF Llama (hidden 64, 2 layers, batch 2x32), forward + loss + backward:
- first call, cold caches: every process starts with empty compile caches (Dynamo,
  AOTAutograd and, for Inductor, its C++ build all count). Goal for the default compiler:
  <= 10 s (printed with the absolute numbers; the ratio is against stock Inductor on CPU).
- a new sequence length: the first call at length 40 after length 32 compiled (Dynamo's
  symbolic recompile and the backend's compile for the new shape). Goal: <= 5 s.
- steady step, default compiler vs eager mode on neuron. Goal: <= 1.1.
- steady step and warm restart with NEURONLOCAL_COMPILER=inductor vs stock Inductor on CPU
  (hidden 128). Goals: <= 1.05 and <= 1.2.
Sides: `cpu-inductor` (plain PyTorch, backend inductor), `neuron` (the default compiler),
`neuron-eager` (no torch.compile), `neuron-inductor`.
Afterwards, in new processes: a cold compile, then a warm one, of the warm-restart step
with Inductor on neuron, with their cache states (a hit must never cost more than a miss).
Run: python bench/compile.py [--rounds N] [--only NAME]
     python bench/compile.py --time-to-n [--rounds R] [--steps 10,100,1000]  (bench/time_to_n.py:
     process start to the end of step N for CPU eager, stock Inductor, the default and the
     tiered compiler on the mid-size Llama)
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, Goal, llama, run_cases  # noqa: E402


def _side(side: str) -> tuple[str, str | None]:
    """(device, backend or None for eager mode); sets the neuron compiler for the side."""
    if side == "neuron-inductor":
        os.environ["NEURONLOCAL_COMPILER"] = "inductor"
    return ("cpu", "inductor") if side == "cpu-inductor" else (
        "neuron", None if side == "neuron-eager" else "neuron")


def step_setup(side: str, hidden: int, layers: int, batch: int, seq: int, cold: bool = False,
               new_seq: int = 0) -> Callable[[], object]:
    """One training step (forward, loss, backward) on `side`; built per process. `cold`:
    empty compile caches for this process. `new_seq`: compile at `seq` here, and time the
    first step at `new_seq`."""
    if cold:
        d = tempfile.mkdtemp(prefix="neuronlocal-bench-cold-")
        atexit.register(shutil.rmtree, d, True)
        os.environ.update({"TORCHINDUCTOR_CACHE_DIR": f"{d}/inductor",
                           "TORCH_NEURONX_NEFF_CACHE_DIR": f"{d}/neff",
                           "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": f"{d}/locks"})
    device, backend = _side(side)
    import torch

    model = llama(hidden, layers).train().to(device)
    fn = (lambda x: model(x, labels=x).loss) if backend is None else torch.compile(
        lambda x: model(x, labels=x).loss, backend=backend)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 1000, (batch, n),
                             generator=torch.Generator().manual_seed(0)).to(device)

    def step(x: torch.Tensor) -> None:
        fn(x).backward()
        model.zero_grad(set_to_none=True)

    if new_seq:
        step(ids(seq))
        later = ids(new_seq)
        return lambda: step(later)
    first = ids(seq)
    return lambda: step(first)


WARM = {"hidden": 128, "layers": 2, "batch": 2, "seq": 32}
TINY = {"hidden": 64, "layers": 2, "batch": 2, "seq": 32}
ONCE = {"repeat": 1, "warmup": 0, "adaptive": False}  # one timed call; a minute a process


def cases(quick: bool) -> list[Case]:
    return [
        Case("first call, cold caches", step_setup, {**TINY, "cold": True},
             sides=("cpu-inductor", "neuron"), **ONCE),
        Case("a new sequence length", step_setup, {**TINY, "cold": True, "new_seq": 40},
             sides=("cpu-inductor", "neuron"), **ONCE),
        Case("steady step: default compiler / eager mode", step_setup, TINY,
             Goal("<=", 1.1), sides=("neuron-eager", "neuron")),
        Case("steady step with Inductor / stock Inductor", step_setup, WARM, Goal("<=", 1.05),
             sides=("cpu-inductor", "neuron-inductor"), prime=True),
        Case("warm restart with Inductor / stock Inductor", step_setup, WARM, Goal("<=", 1.2),
             sides=("cpu-inductor", "neuron-inductor"), prime=True, repeat=1, warmup=0),
    ]


_PROC = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from compile import WARM, step_setup
run = step_setup("neuron-inductor", **WARM)
t = time.perf_counter()
run()
wall = time.perf_counter() - t
m = torch.neuron.get_dynamo_metrics()
print(json.dumps({{"wall": wall, "cache": [g["cache"] for g in m["graphs"]]}}))
"""


def cold_vs_warm(args: Any) -> dict[str, Any]:
    """First neuron step (Inductor) with an empty cache, then with the cache that run filled."""
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
    if "--time-to-n" in sys.argv:
        import time_to_n

        sys.argv.remove("--time-to-n")
        time_to_n.main()
        return
    # One private cache folder for both sides and every process of this run, so each
    # process after the priming one starts warm, as a restarted job does.
    with tempfile.TemporaryDirectory(prefix="neuronlocal-bench-") as d:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{d}/inductor")
        os.environ.setdefault("TORCH_NEURONX_NEFF_CACHE_DIR", f"{d}/neff")
        os.environ.setdefault("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", f"{d}/locks")
        run_cases(__file__, cases, title="compile: time ratio b / a",
                  description=__doc__, extra=cold_vs_warm)


if __name__ == "__main__":
    main()
