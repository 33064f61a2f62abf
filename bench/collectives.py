"""all_reduce bus bandwidth: backend `neuron` on neuron tensors / raw gloo on CPU tensors.

Both run in the same 2-rank job (one torchrun launch), interleaved size by size, so the
ratio compares like with like on a shared machine. Goal: ratio >= 0.9 at 1 MiB and above.
Bus bandwidth = bytes * 2 (n - 1) / n / time (the nccl-tests convention).

Run: python bench/collectives.py [--max-mib 64] [--checks]   (launches torchrun itself)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _time(fn: object, iters: int) -> float:
    import torch.distributed as dist

    fn()  # warm up
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def worker(max_mib: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="neuron")
    gloo = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{'size':>9} {'neuron GB/s':>12} {'gloo GB/s':>10} {'ratio':>6}")
    size = 1024
    while size <= max_mib * 2**20:
        numel = size // 4
        a = torch.ones(numel, device="neuron")
        b = torch.ones(numel)
        iters = max(3, min(100, (32 * 2**20) // size))
        best_n = best_g = float("inf")
        for _ in range(5):  # interleave, keep the best of each
            best_n = min(best_n, _time(lambda a=a: dist.all_reduce(a), iters))
            best_g = min(best_g, _time(lambda b=b: dist.all_reduce(b, group=gloo), iters))
        bus = size * 2 * (n - 1) / n
        if rank == 0:
            label = f"{size // 1024} KiB" if size < 2**20 else f"{size // 2**20} MiB"
            print(f"{label:>9} {bus / best_n / 1e9:12.3f} {bus / best_g / 1e9:10.3f} "
                  f"{best_g / best_n:6.2f}", flush=True)
        size *= 4
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--checks", action="store_true", help="NEURONLOCAL_DIST_CHECKS=1")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.max_mib)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "NEURONLOCAL_DIST_CHECKS": "1" if a.checks else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           __file__, "--worker", "--max-mib", str(a.max_mib)]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
