"""all_reduce bus bandwidth: backend `neuron` on neuron tensors / raw gloo on CPU tensors.

Both run in one 2-rank job (torchrun), so they share the process pair; what keeps the
comparison fair on a shared machine is the schedule: for each size, `--rounds` rounds,
each timing a block of all_reduces on both backends back to back, in alternating order
(neuron first on even rounds, gloo first on odd ones), every block started after a barrier
and long enough (about `--block-ms`) that one scheduling hiccup is a small part of it.
Each backend's number is the median block over rounds (spread: min-max range in percent
of the median); the ratio is taken per round (gloo time / neuron time: neuron's share of
gloo's bandwidth) and reported as its median with range. Goal: >= 0.95 at 1 MiB and above.
Bus bandwidth = bytes * 2 (n - 1) / n / time (the nccl-tests convention).

`--runs 3` repeats the whole job and reports how far the runs' median ratios are apart at
1 MiB and above (they should agree within 10%).
Run: python bench/collectives.py [--max-mib 64] [--rounds 15] [--runs 3] [--checks]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Case, Goal, Result, summarize, table, write_reports  # noqa: E402

_MARK = "BENCH_RESULT "
MIB = 2**20


def _block(fn: object, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t) / iters


def worker(max_mib: int, rounds: int, block_ms: float) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="neuron")
    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    size = 1024
    while size <= max_mib * MIB:
        numel = size // 4
        a = torch.ones(numel, device="neuron")
        b = torch.ones(numel)
        runs = {"neuron": lambda a=a: dist.all_reduce(a),
                "gloo": lambda b=b: dist.all_reduce(b, group=gloo)}
        for fn in runs.values():  # warm up, then size the blocks from the slower backend
            fn()
        probe = max(_block(fn, 3) for fn in runs.values())
        t = torch.tensor([probe])
        dist.all_reduce(t, group=gloo, op=dist.ReduceOp.MAX)  # both ranks use one count
        iters = max(3, min(2000, int(block_ms / 1e3 / max(t.item(), 1e-7))))
        times: dict[str, list[float]] = {"neuron": [], "gloo": []}
        for r in range(rounds):
            order = ("neuron", "gloo") if r % 2 == 0 else ("gloo", "neuron")
            for name in order:
                times[name].append(_block(runs[name], iters))
        if rank == 0:
            print(_MARK + json.dumps({"bytes": size, "iters": iters, **times}), flush=True)
        size *= 4
    dist.destroy_process_group()


def _label(size: int) -> str:
    return f"{size // 1024} KiB" if size < MIB else f"{size // MIB} MiB"


def run_job(args: argparse.Namespace) -> list[Result]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "NEURONLOCAL_DIST_CHECKS": "1" if args.checks else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__,
           "--worker", "--max-mib", str(args.max_mib), "--rounds", str(args.rounds),
           "--block-ms", str(args.block_ms)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(x[len(_MARK):]) for x in p.stdout.splitlines() if x.startswith(_MARK)]
    if p.returncode or not rows:
        raise RuntimeError(f"collectives job failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    results = []
    for row in rows:
        size = row["bytes"]
        bus = size * 2 * (2 - 1) / 2 / 1e9  # GB moved per call on the bus, 2 ranks
        case = Case(f"all_reduce {_label(size)}", lambda side: lambda: None, {},
                    Goal(">=", 0.95) if size >= MIB else None, ("gloo", "neuron"),
                    speedup=True, per_call=bus, rate_unit="GB/s")
        results.append(summarize(case, row["gloo"], row["neuron"]))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds per size")
    p.add_argument("--block-ms", type=float, default=40.0, help="target length of a block")
    p.add_argument("--runs", type=int, default=1, help="repeat the job; report agreement")
    p.add_argument("--checks", action="store_true", help="NEURONLOCAL_DIST_CHECKS=1")
    p.add_argument("--out", type=Path, default=Path("reports/bench"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.max_mib, a.rounds, a.block_ms)
        return
    from tqdm import tqdm

    runs = [run_job(a) for _ in tqdm(range(a.runs), desc="collectives jobs", unit="job")]
    for i, results in enumerate(runs):
        table(results, f"all_reduce, 2 ranks, run {i + 1}/{a.runs}: gloo time / neuron time "
                       f"per round, median over {a.rounds} rounds (bus GB/s gloo / neuron)")
    meta = {"rounds": a.rounds, "block_ms": a.block_ms, "runs": a.runs,
            "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    if a.runs > 1:
        worst = 0.0
        for k, r in enumerate(runs[0]):
            if r.goal is None:
                continue
            meds = [run[k].ratio.median for run in runs]
            dev = (max(meds) - min(meds)) / statistics.median(meds)
            worst = max(worst, dev)
            print(f"{r.case}: median ratios over runs {', '.join(f'{m:.3f}' for m in meds)} "
                  f"(apart {100 * dev:.1f}%)")
        print(f"runs agree within {100 * worst:.1f}% at 1 MiB and above (goal: 10%)")
        meta["max_disagreement_1mib_up"] = worst
    j, h = write_reports(runs[-1], "collectives", "all_reduce: neuron / gloo", a.out, meta)
    print(f"reports: {j} {h}")


if __name__ == "__main__":
    main()
