"""Where a training step's time goes, per op kind: plain CPU next to neuron.

Runs the eager training step of bench/eager.py (tiny Llama by default: forward, backward,
AdamW) under torch.profiler, each device in its own process, and sums the profiler's
self CPU time per op kind (matmuls, attention, elementwise, optimizer, autograd engine,
...), per step. The profiler records one event per op on neuron (its host kernel runs
inside it), so rows compare like with like. The profiler times wall clock, which load on a
shared machine inflates: the sides alternate for `--rounds` processes each and every op
keeps its smallest per-step time over them; `--threads 1` steadies it further.
Run: python bench/step_profile.py [--hidden 256 --layers 4 --batch 2 --seq 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

_MARK = "BENCH_RESULT "

# First match wins; names are profiler event names.
KINDS: list[tuple[str, str]] = [
    ("optimizer (foreach / fused)", r"_foreach_|_fused_adam|_fused_sgd|neuron::foreach_run"),
    ("optimizer step (Python)", r"^Optimizer\.step"),
    ("zero_grad", r"^Optimizer\.zero_grad"),
    ("matmul", r"aten::(mm|addmm|bmm|matmul|linear|baddbmm)$"),
    ("attention", r"scaled_dot_product|flash_attention"),
    ("autograd engine and nodes", r"^autograd::|Backward|AccumulateGrad"),
    ("loss, softmax", r"softmax|nll_loss|cross_entropy"),
    ("embedding", r"embedding"),
    ("reductions", r"aten::(sum|mean|amax|max|min|norm|linalg_vector_norm)"),
    ("views and metadata", r"aten::(view|t|transpose|reshape|_reshape_alias|as_strided|slice|"
                           r"select|unsqueeze|squeeze|expand|permute|detach|alias|"
                           r"_unsafe_view|split|chunk|unbind|contiguous|lift_fresh)$"),
    ("allocation", r"aten::(empty|empty_strided|empty_like|zeros|zeros_like|ones_like|"
                   r"full|new_empty|new_zeros|resize_)"),
    ("copies and casts", r"aten::(copy_|_to_copy|to|clone|cat|_local_scalar_dense|item)"),
    ("elementwise", r"aten::"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


def worker(side: str, args: argparse.Namespace) -> None:
    import torch
    from eager import train_step
    from torch.profiler import ProfilerActivity, profile

    if args.threads:
        torch.set_num_threads(args.threads)
    step = train_step(side, args.hidden, args.layers, args.batch, args.seq)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    per_op = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
    print(_MARK + json.dumps({"ops": per_op}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="processes per side, alternated")
    p.add_argument("--top", type=int, default=12, help="also list the top ops by difference")
    p.add_argument("--out", type=Path, default=Path("reports/bench"))
    p.add_argument("--worker", choices=("cpu", "neuron"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a)
        return
    got: dict[str, dict[str, dict[str, float]]] = {"cpu": {"ops": {}}, "neuron": {"ops": {}}}
    for r in range(a.rounds):
        for side in ("cpu", "neuron") if r % 2 == 0 else ("neuron", "cpu"):
            cmd = [sys.executable, __file__, "--worker", side] + sys.argv[1:]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
            if not lines:
                raise SystemExit(f"{side} worker failed:\n{proc.stderr[-3000:]}")
            ops = got[side]["ops"]
            for op, ms in json.loads(lines[0][len(_MARK):])["ops"].items():
                ops[op] = min(ops.get(op, ms), ms)
    for side in got:
        kinds: dict[str, float] = {}
        for op, ms in got[side]["ops"].items():
            kinds[kind_of(op)] = kinds.get(kind_of(op), 0.0) + ms
        got[side]["kinds"] = kinds
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"self CPU ms per step, Llama h{a.hidden} L{a.layers} {a.batch}x{a.seq} "
                    "training step (profiler, indicative)")
    for col in ("op kind", "cpu", "neuron", "neuron - cpu"):
        t.add_column(col, justify="left" if col == "op kind" else "right")
    kinds = [k for k, _ in KINDS] + ["other"]
    tot = {s: sum(got[s]["kinds"].values()) for s in got}
    for k in kinds:
        c, n = got["cpu"]["kinds"].get(k, 0.0), got["neuron"]["kinds"].get(k, 0.0)
        if c or n:
            t.add_row(k, f"{c:.2f}", f"{n:.2f}", f"{n - c:+.2f}")
    t.add_row("total", f"{tot['cpu']:.2f}", f"{tot['neuron']:.2f}",
              f"{tot['neuron'] - tot['cpu']:+.2f}")
    Console().print(t)
    ops = set(got["cpu"]["ops"]) | set(got["neuron"]["ops"])
    diff = sorted(ops, key=lambda o: -abs(got["neuron"]["ops"].get(o, 0)
                                          - got["cpu"]["ops"].get(o, 0)))
    for o in diff[:a.top]:
        c, n = got["cpu"]["ops"].get(o, 0.0), got["neuron"]["ops"].get(o, 0.0)
        print(f"  {o[:60]:60s} cpu {c:7.2f}  neuron {n:7.2f}  ({n - c:+.2f})")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "step_profile.json"
    path.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, **got,
                                "load_average": os.getloadavg()[0]}, indent=2, default=str))
    print(f"report: {path}")


if __name__ == "__main__":
    main()
