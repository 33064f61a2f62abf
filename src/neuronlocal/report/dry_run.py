"""`neuronlocal run --dry-run`: the user's unchanged script at its real size and world size.

Each simulated rank runs in its own process under the run report (report/runner.py), as
many at once as there are CPU cores (`--jobs`), each output line tagged with its rank when
more than one runs, with the variables torchrun would set and NEURONLOCAL_DRY_RUN=1: its
neuron tensors hold no bytes, its collectives complete without peers (core/dryrun.py,
distributed/backend.py). Then this module reads the ranks' reports and adds the dry-run
summary to report.json and report.html: peak HBM per rank against the core's HBM with its
breakdown and the op and line that set it, collectives by group size with their link class
and time, the step time, tokens/s, MFU and dollars (report/dry_price.py), the compile bill,
and every value the run assumed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from neuronlocal.core import hardware
from neuronlocal.core.config import ConfigError, parse_routing
from neuronlocal.core.dryrun import BREAKDOWN
from neuronlocal.core.files import read_json, write_private
from neuronlocal.core.units import fmt_bytes
from neuronlocal.report import dry_price, dry_view, render, runner

MASTER_PORT = "29500"


class DryRunError(ValueError):
    """Bad dry-run options: the one-line message."""


def parse_ranks(spec: str | None, world: int) -> list[int]:
    """`--ranks`: None (rank 0 and the last), `all`, or a comma list such as `0,7,63`."""
    if spec is None:
        return sorted({0, world - 1})
    if spec == "all":
        return list(range(world))
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise DryRunError(f"--ranks {spec!r}: give `all` or ranks such as 0,{world - 1}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise DryRunError(f"--ranks {spec!r}: ranks must be in 0..{world - 1} (world size "
                          f"{world})")
    return ranks


def rank_env(rank: int, nproc: int, nnodes: int, run_id: str, steps: int,
             instance: str | None, master: tuple[str | None, int | None] = (None, None),
             routing: str | None = None) -> dict[str, str]:
    """The variables torchrun sets for `rank`, plus the dry-run switches."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(nproc * nnodes), "LOCAL_RANK": str(rank % nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(rank // nproc),
           "NODE_RANK": str(rank // nproc), "ROLE_RANK": str(rank),
           "ROLE_WORLD_SIZE": str(nproc * nnodes), "MASTER_ADDR": master[0] or "127.0.0.1",
           "MASTER_PORT": str(master[1] or MASTER_PORT), "TORCHELASTIC_RUN_ID": run_id,
           "NEURONLOCAL_DRY_RUN": "1", "NEURONLOCAL_DRY_RUN_STEPS": str(steps)}
    if instance:
        env["NEURONLOCAL_INSTANCE"] = instance
    if routing:
        env["NEURONLOCAL_DRY_RUN_ROUTING"] = routing
    return env


def default_jobs(ranks: int) -> int:
    """Simulated ranks run at once by default: one per CPU core this process may use, at
    most the ranks. A rank keeps about one core busy and holds 0.5-1 GiB of host memory at
    8B-70B, so running more at once than there are cores only slows each one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(ranks, cores))


def _relay(stream: IO[bytes], sink: IO[bytes], prefix: bytes) -> None:
    """Copies a child's output to ours line by line, each line tagged with its rank (as
    torchrun's --tee tags them), so ranks running at once do not interleave mid-line."""
    for line in iter(stream.readline, b""):
        sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        sink.flush()
    stream.close()


def _start(rank: int, world: int, args: list[str], module: str | None, out: Path, run_id: str,
           env: dict[str, str], tagged: bool) -> tuple[runner.Child, list[threading.Thread]]:
    print(f"neuronlocal dry run: rank {rank} of {world} started", file=sys.stderr)
    child = runner.start(args, module, out, run_id, env={**os.environ, **env}, pipe=tagged)
    relays = []
    if tagged:
        prefix = f"[rank{rank}]: ".encode()
        for stream, sink in ((child.proc.stdout, sys.stdout.buffer),
                             (child.proc.stderr, sys.stderr.buffer)):
            assert stream is not None
            t = threading.Thread(target=_relay, args=(stream, sink, prefix), daemon=True)
            t.start()
            relays.append(t)
    return child, relays


def _run_ranks(chosen: list[int], world: int, jobs: int, args: list[str], module: str | None,
               out: Path, run_id: str, env_of: Callable[[int], dict[str, str]]) -> list[int]:
    """Runs the simulated ranks, `jobs` at a time, each in its own child with its own
    environment; returns their exit statuses. When one could not start its script (no
    such module: no rank file), the ranks not yet started are not."""
    pending = list(chosen)
    running: dict[int, tuple[int, runner.Child, list[threading.Thread]]] = {}
    procs: list[subprocess.Popen[bytes]] = []
    codes: list[int] = []
    tagged = jobs > 1
    previous = runner.forwarding(procs)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                rank = pending.pop(0)
                child, relays = _start(rank, world, args, module, out, run_id, env_of(rank),
                                       tagged)
                running[child.proc.pid] = (rank, child, relays)
                procs.append(child.proc)
            pid, status = os.wait()
            if pid not in running:
                continue
            rank, child, relays = running.pop(pid)
            procs.remove(child.proc)
            code = os.waitstatus_to_exitcode(status)
            child.proc.returncode = code  # os.wait reaped it: Popen must not wait again
            for t in relays:
                t.join()
            codes.append(runner.finish(child, code, quiet=True))
            print(f"neuronlocal dry run: rank {rank} of {world} ended (status {codes[-1]}, "
                  f"{time.monotonic() - child.started:.0f} s)", file=sys.stderr)
            if codes[-1] and not (out / f"rank{rank}.json").exists():
                pending.clear()  # the script could not start: runner said why
    finally:
        runner.restore(previous)
    return codes


def _verdict(r: dict[str, Any]) -> str:
    """"fits with X GiB to spare", or where and by how much the core's HBM runs out."""
    if r["fits"]:
        return f"fits with {fmt_bytes(r['hbm_bytes'] - r['peak_reserved_bytes'])} to spare"
    where = r["oom_at"] or "?"
    op = f" ({r['oom_op']})" if r.get("oom_op") else ""
    return (f"would run out of memory at {where}{op}: needs "
            f"{fmt_bytes(r['peak_reserved_bytes'])} of {fmt_bytes(r['hbm_bytes'])}")


def _rank_summary(rep: dict[str, Any]) -> dict[str, Any]:
    dry = rep.get("dry_run") or {}
    cores = rep.get("memory") or []
    core = max(cores, key=lambda c: c["peak_bytes"]) if cores else None
    peak = core["peak_bytes"] if core else 0
    reserved = core["reserved_peak_bytes"] if core else 0
    hbm = core["hbm_bytes"] if core else 0
    at_peak = next((p for p in dry.get("peaks", []) if core and p["core"] == core["core"]),
                   None) or {}
    ooms = [r for r in dry.get("reads", []) if r["op"].startswith("out of memory")]
    oom = ooms[0]["op"] if ooms else None
    err = rep["run"].get("error")
    out = {
        "rank": rep["rank"], "core": core["core"] if core else None,
        "peak_hbm_bytes": peak, "peak_reserved_bytes": reserved, "hbm_bytes": hbm,
        "fits": core is not None and not core.get("dry_ooms"),
        "peak_at": at_peak.get("at"), "peak_op": at_peak.get("op"),
        "oom": oom, "oom_at": ooms[0]["at"] if ooms else None,
        "oom_op": oom.rsplit(" in ", 1)[1] if oom and " in " in oom else None,
        "breakdown": at_peak.get("breakdown") or dict.fromkeys(BREAKDOWN, 0),
        "model_state": dry.get("model_state") or {},
        "steps": dry.get("steps", 0),
        "exit_code": rep["run"].get("exit_code"),
        "error": f"{err['type']}: {err['message']}" if err else None,
        "assumed_values": [r for r in dry.get("reads", [])
                           if not r["op"].startswith("out of memory")],
    }
    out["verdict"] = _verdict(out)
    return out


def _assumed_sites(per_rank: list[dict[str, Any]]) -> list[str]:
    """One line per place a value was assumed, over the simulated ranks, with its count."""
    sites: dict[tuple[str, str], list[int]] = {}
    for r in per_rank:
        for a in r["assumed_values"]:
            sites.setdefault((a["op"], a["at"]), []).append(a["count"])
    return [dry_view.assumed_line({"op": op, "at": at, "count": max(counts)})
            + (f" on each of {len(counts)} ranks" if len(counts) > 1 else "")
            for (op, at), counts in sites.items()]


def summarize(ranks: list[dict[str, Any]], world: int, instance: str,
              prof: hardware.Profile, nproc: int, nnodes: int = 1,
              tokens_per_step: int | None = None) -> dict[str, Any]:
    """The `dry_run` section of report.json, from the simulated ranks' reports."""
    per_rank = [_rank_summary(r) for r in ranks]
    first = ranks[0] if ranks else {}
    colls = [{"op": c["op"], "group_size": c["group_size"], "bytes": c["bytes"],
              "calls": c["count"], "link": c["link"]}
             for c in (first.get("dry_run") or {}).get("collective_groups", [])]
    steps = max((r["steps"] for r in per_rank), default=0)
    spec = dry_price.spec_of(prof.instance, prof.lnc)
    bill = dry_price.compile_bill(ranks)
    priced = dry_price.cost(ranks, world, nnodes, spec, tokens_per_step)
    return {
        "world_size": world, "instance": instance, "nodes": nnodes, "ranks": per_rank,
        "collectives": dry_price.priced_collectives(
            sorted(colls, key=lambda c: -c["bytes"]), steps, spec, nproc),
        "collectives_of_rank": first.get("rank"),
        "steps": steps, **bill,
        "recompiles": [{"rank": r["rank"], "graph": e["graph"], "reason": e["reason"]}
                       for r in ranks for e in r.get("recompiles") or []],
        **{k: v for k, v in priced.items() if k not in ("assumptions", "missing")},
        "assumptions": [
            "measured: peak HBM is the allocator's count of the bytes a real run allocates "
            "(same size classes, segments and OOM rule), with no bytes behind them",
            "measured: breakdown is what the live blocks held when allocated bytes reached "
            "their peak (they add up to peak_hbm_bytes): parameters, gradients and "
            "optimizer state of the optimizer (and live nn.Parameters), tensors autograd "
            "saved for backward (activations), results of collectives (an FSDP all-gather's "
            "unsharded weights), the rest temporaries; a block holding two kinds counts "
            "once, in that order",
            "measured: model_state is the optimizer's parameters, gradients and state on "
            "this rank at its step",
            "assumed: every rank holds this rank's data (uniform-rank collectives); index "
            "math on values the run has (token ids, counts, masks) is computed for real, "
            "indices of topk/sort/argmax/max over values it lacks follow the routing policy "
            "(NEURONLOCAL_DRY_RUN_ROUTING), any other value read from the device is zero; "
            "each site follows",
            *_assumed_sites(per_rank),
            "link: each group's class from its member ranks (same chip, "
            "NeuronLink between chips of a node, EFA between nodes), with torchrun's layout: "
            f"rank r on node r // {nproc}, its core r % {nproc}, {prof.cores_per_chip} "
            "logical cores per chip",
            f"collective bytes are rank {first.get('rank')}'s result tensors over "
            f"{steps} step(s); seconds_per_step prices them over the steps run",
            *priced["assumptions"], dry_price.compile_assumption(),
        ],
        "missing": priced["missing"],
    }


def run(args: list[str], module: str | None, report_dir: str | Path, nproc: int = 1,
        nnodes: int = 1, ranks: str | None = None, steps: int = 2,
        instance: str | None = None,
        master: tuple[str | None, int | None] = (None, None),
        tokens_per_step: int | None = None, routing: str | None = None,
        jobs: int | None = None) -> int:
    """Runs the simulated ranks, `jobs` at once (default_jobs), then writes and prints the
    dry-run summary.
    `tokens_per_step`: the job's tokens per optimizer step, where the embedding's count
    (every rank its own batch) is not it; `routing`: the routing policy (config.py)."""
    world = nproc * nnodes
    env_instance = {"NEURONLOCAL_INSTANCE": instance} if instance else {}
    try:
        chosen = parse_ranks(ranks, world)
        if routing:
            try:
                parse_routing("--routing", routing)
            except ConfigError as e:
                raise DryRunError(f"neuronlocal run --dry-run: {e}") from None
        cfg, prof, error = hardware.load({**os.environ, **env_instance})
        if error:
            raise DryRunError(f"neuronlocal run --dry-run: {error}")
        if nproc > prof.total_cores:
            raise DryRunError(
                f"neuronlocal run --dry-run: --nproc-per-node {nproc} but {prof.instance} "
                f"(LNC={prof.lnc}) has {prof.total_cores} logical NeuronCores; pass "
                "--instance trn2.48xlarge (64 at LNC=2) or fewer ranks per node")
    except DryRunError as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(report_dir)
    run_id = f"dry-{os.getpid()}-{time.time():.0f}"
    jobs = jobs or default_jobs(len(chosen))
    try:
        codes = _run_ranks(chosen, world, jobs, args, module, out, run_id,
                           lambda r: rank_env(r, nproc, nnodes, run_id, steps, instance,
                                              master, routing))
    except runner.RunError as e:
        print(e, file=sys.stderr)
        return e.code
    reps = []
    for rank in chosen:
        with contextlib.suppress(OSError, ValueError):
            rep = read_json(out / f"rank{rank}.json")
            if rep["run"].get("run_id") == run_id:
                reps.append(rep)
    failed = [c for c in codes if c]
    if not reps:  # no rank ran the script (it could not start): nothing to summarize
        print(f"neuronlocal dry run: no simulated rank wrote a report; nothing in {out}/",
              file=sys.stderr)
        return failed[0] if failed else 1
    summary = summarize(reps, world, prof.instance, prof, nproc, nnodes, tokens_per_step)
    merged = render.merge(reps)
    merged["dry_run"] = summary
    write_private(out / "report.json", render.to_json(merged))
    write_private(out / "report.html", render.html_page(merged, dry_view.html(summary)))
    for line in dry_view.lines(summary):
        print(line)
    print(f"neuronlocal: dry-run report in {out}/report.json", file=sys.stderr)
    return failed[0] if failed else 0
