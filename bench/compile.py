"""Compiled cost: neuron / Inductor on plain CPU, measured in the same run (issue 3 goals).

(a) compiled forward+backward, Llama hidden 1024, 8 layers, batch 4x256: goal <= 1.05
(b) HF static-cache greedy decode tokens/s, compiled, neuron / CPU:       goal >= 0.95
(c) warm-cache compile time in a new process / cold compile time:       goal <= 0.1
Run: python bench/compile.py [--quick]   (--quick: hidden 256, 4 layers, batch 2x64)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_of, llama  # noqa: E402


def train_ratio(hidden: int, layers: int, batch: int, seq: int, repeat: int) -> tuple[float, float]:
    cpu = llama(hidden, layers).train()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(0, 1000, (batch, seq))

    def step(model: torch.nn.Module, fn, x: torch.Tensor):  # type: ignore[no-untyped-def]
        def run() -> None:
            fn(x).backward()
            model.zero_grad(set_to_none=True)
        return run

    fc = torch.compile(lambda x: cpu(x, labels=x).loss, backend="inductor")
    fn = torch.compile(lambda x: dev(x, labels=x).loss, backend="neuron")
    t_cpu = best_of(step(cpu, fc, ids), repeat, warmup=2)
    t_dev = best_of(step(dev, fn, ids.to("neuron")), repeat, warmup=2)
    return t_cpu, t_dev


def decode_ratio(hidden: int, layers: int, new_tokens: int) -> tuple[float, float]:
    cpu = llama(hidden, layers)
    dev = copy.deepcopy(cpu).to("neuron")
    prompt = torch.randint(0, 1000, (1, 16))

    def gen(model: torch.nn.Module, ids: torch.Tensor):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            return model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                  cache_implementation="static", min_new_tokens=new_tokens)
        return run

    from transformers import CompileConfig

    # neuron auto-compiles generate() with backend "neuron" (transformers' own neuron path);
    # the CPU baseline is compiled the same way with Inductor.
    cc = CompileConfig(backend="inductor", dynamic=False, mode="default")
    cc._compile_all_devices = True
    cpu.generation_config.compile_config = cc
    with torch.no_grad():
        t_cpu = best_of(gen(cpu, prompt), 3, warmup=2)
        t_dev = best_of(gen(dev, prompt.to("neuron")), 3, warmup=2)
    # tokens/s ratio neuron/cpu = t_cpu / t_dev
    return t_cpu, t_dev


_PROC = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from _common import llama
model = llama(256, 4).train().to("neuron")
ids = torch.randint(0, 1000, (2, 64), device="neuron")
t = time.perf_counter()
loss = torch.compile(lambda x: model(x, labels=x).loss, backend="neuron")(ids)
loss.backward()
wall = time.perf_counter() - t
m = torch.neuron.get_dynamo_metrics()
print(json.dumps({{"wall": wall, "backend": m["compile_seconds"],
                  "cache": [g["cache"] for g in m["graphs"]]}}))
"""


def cache_ratio() -> tuple[dict, dict]:
    """Cold then warm compile of tiny-Llama fwd+bwd, each in a new process, one cache dir."""
    code = textwrap.dedent(_PROC).format(bench=str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": f"{d}/neff",
               "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": f"{d}/locks"}
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    return runs[0], runs[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    h, n, b, s = (256, 4, 2, 64) if args.quick else (1024, 8, 4, 256)
    rows = []
    t0 = time.perf_counter()
    tc, tn = train_ratio(h, n, b, s, 3)
    rows.append(("(a) compiled fwd+bwd", tc, tn, tn / tc, "<=1.05"))
    tc, tn = decode_ratio(256 if args.quick else 512, 4, 32)
    rows.append(("(b) static-cache decode tok/s", tc, tn, tc / tn, ">=0.95"))
    cold, warm = cache_ratio()
    rows.append(("(c) warm/cold backend compile s", cold["backend"], warm["backend"],
                 warm["backend"] / cold["backend"], "<=0.1"))
    rows.append(("    same, wall incl. tracing", cold["wall"], warm["wall"],
                 warm["wall"] / cold["wall"], "-"))
    print(f"cache states: cold {cold['cache']}, warm {warm['cache']}")
    print(f"{'case':<32}{'cpu/cold s':>12}{'neuron/warm s':>15}{'ratio':>8}{'goal':>8}")
    for name, a, c, r, g in rows:
        print(f"{name:<32}{a:>12.4f}{c:>15.4f}{r:>8.3f}{g:>8}")
    print(f"total {time.perf_counter() - t0:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
