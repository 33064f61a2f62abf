"""The `neuronlocal` command: info, demo, check, support, ops, env, run, estimate,
serve-plan."""

from __future__ import annotations

import argparse
import sys

import torch

import neuronlocal
from neuronlocal.core.config import env_table_markdown, set_variables
from neuronlocal.core.options import Parser, amount, whole
from neuronlocal.core.units import fmt_bytes
from neuronlocal.eager import ops as ops_mod


def _unavailable() -> int:
    """Prints why the device is unavailable (a bad environment variable); 1 if it is."""
    if neuronlocal.config_error is None:
        return 0
    print(f"neuronlocal: neuron device unavailable: {neuronlocal.config_error} "
          "(`neuronlocal env` lists the variables and their accepted values)", file=sys.stderr)
    return 1


def cmd_info(_: argparse.Namespace) -> int:
    p = neuronlocal.profile
    print(f"neuronlocal {neuronlocal.__version__} on torch {torch.__version__}")
    if _unavailable():
        return 1
    print(f"instance        {p.instance} ({p.chips} x {p.chip.name}, "
          f"{p.chip.physical_cores} physical cores and {fmt_bytes(p.chip.hbm_bytes, 1)} HBM "
          "per chip)")
    print(f"LNC             {p.lnc} -> {p.cores_per_chip} logical cores per chip, "
          f"{p.total_cores} on the instance")
    print(f"visible cores   {list(p.visible)} -> torch.neuron.device_count() = {p.device_count}")
    print(f"HBM per core    {fmt_bytes(p.hbm_per_core, 1)}")
    print(f"64-bit policy   {'compute as 32-bit' if neuronlocal.config.downcast_64bit else 'off'}")
    print(f"strict mode     {'on' if neuronlocal.config.strict else 'off'}")
    return 0


def cmd_demo(_: argparse.Namespace) -> int:
    from neuronlocal import demo

    if cmd_info(_):
        return 1
    r = demo.run()
    print("\ndemo: tiny transformer LM, forward + backward, neuron vs CPU")
    print(f"  loss            cpu {r.loss_cpu:.6f}   neuron {r.loss_neuron:.6f}")
    print(f"  max |logit diff| {r.max_logit_diff:.2e}   max |grad diff| {r.max_grad_diff:.2e}")
    print(f"  step time       cpu {r.ms_cpu:.1f} ms   neuron {r.ms_neuron:.1f} ms "
          f"(host emulation; not Trainium timings)")
    print(f"  peak HBM        {r.peak_hbm / 2**20:.2f} MiB on neuron:0")
    fallbacks = neuronlocal.get_fallback_ops()
    print(f"  CPU fallbacks   {dict(fallbacks) or 'none'}")
    print(f"  64-bit downcasts {dict(neuronlocal.get_downcast_ops()) or 'none'}")
    ok = r.max_logit_diff < 1e-4 and r.max_grad_diff < 1e-4
    print("\nresult: " + ("neuron matches CPU" if ok else "MISMATCH between neuron and CPU"))
    return 0 if ok else 1


def cmd_ops(args: argparse.Namespace) -> int:
    """Where TorchNeuron runs ops on Trainium (the placement table, eager/ops.py)."""
    from neuronlocal.kernels import library  # noqa: F401 - its kernel ops are device ops

    kernel_ops = sorted(ops_mod.device_kernels())
    if args.op:
        code = 0
        for name in args.op:
            try:
                p = ops_mod.placement(name)
            except KeyError as e:
                print(f"error: {e.args[0]}")
                code = 2
                continue
            runs = f"; runs on the host as {p.host_op}" if p.runs == "host" and \
                p.placement != "host" else ""
            print(f"{p.op}: {p.placement}{runs}\n  {p.evidence()}")
        return code
    every = ops_mod.all_placements()
    if args.list:
        for name, p in every.items():
            if args.list == "host" and p.runs == "host":
                print(name if p.host_op == name else f"{name}  (runs {p.host_op})")
            elif args.list == p.placement and args.list != "host":
                print(name)
        if args.list == "device":
            print("\n".join(kernel_ops))
        return 0
    t = ops_mod.table()
    counts = {k: sum(p.placement == k for p in every.values()) for k in ops_mod.PLACEMENTS}
    direct = [p for p in every.values() if "runs" in p.entry]
    on_host = sum(p.runs == "host" for p in direct)
    print(f"Op placement on Trainium for the {len(every)} ATen ops of torch {t['torch']}, from "
          f"TorchNeuron's public op coverage ({t['evidence']['source']}, extracted "
          f"{t['evidence']['extracted']}):")
    print(f"  device     {counts['device']:>5}  TorchNeuron registers a device kernel")
    print(f"  composite  {counts['composite']:>5}  decomposes; its pieces are placed one by one "
          f"({len(direct)} run here as one CPU kernel: {on_host} of them fall back)")
    print(f"  host       {counts['host']:>5}  TorchNeuron's CPU fallback: copied to the host and "
          "back, warned once per op, an error with NEURONLOCAL_STRICT=1")
    print(f"  kernels    {len(kernel_ops):>5}  device: NKI kernels (neuronlocal's kernel library"
          f" and every nki_op), one fused kernel on the NeuronCore: {', '.join(kernel_ops)}")
    print("`neuronlocal ops OP...` explains ops, `--list host` lists every op that runs on the "
          "host; docs/op-support.md.")
    print(f"Placement now: {neuronlocal.config.placement} (NEURONLOCAL_OP_PLACEMENT=native counts "
          "every op as a device op).")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from neuronlocal.support import check

    return check.run(args.config, args.model_dir, args.model_type,
                     trust_remote_code=args.trust_remote_code, task=args.task)


def cmd_support(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronlocal.support import configs, matrix

    try:
        if args.list:
            print("\n".join(f"{mt:<28}{arch}" for mt, arch in matrix.architectures(args.task)))
            return 0
        only = matrix.CI_SUBSET if args.subset == "ci" else (
            args.models.split(",") if args.models is not None else None)
        data = matrix.run_matrix(args.task, Path(args.out), jobs=args.jobs,
                                 timeout=args.timeout, only=only, force=args.force,
                                 max_memory=args.max_memory * matrix.GiB)
    except configs.BadInput as e:
        print(f"error: {e}")
        return 2
    from neuronlocal.support import render

    s = data["summary"]
    print(f"{render.headline(data)}\nreport: {args.out}/support-{args.task}.html")
    if s["counts"].get("neuron-fail", 0):
        return 1
    return 0 if s["tested"] else 3


def cmd_env(_: argparse.Namespace) -> int:
    print(env_table_markdown())
    current = set_variables()
    problems = neuronlocal.config_error.problems if neuronlocal.config_error else []
    if current:
        print("\nSet in this environment:")
    for name, raw in current:
        bad = [p for p in problems if p.startswith(f"{name}=")]
        print(f"  {name}={raw}" + (f"   <- error: {bad[0]}" if bad else ""))
    return _unavailable()


def cmd_run(args: argparse.Namespace) -> int:
    from neuronlocal.report import runner

    if args.dry_run:
        from neuronlocal.report import dry_run

        return dry_run.run(args.args, args.module, args.report, nproc=args.nproc_per_node,
                           nnodes=args.nnodes, ranks=args.ranks, steps=args.steps,
                           instance=args.instance, master=(args.master_addr, args.master_port),
                           tokens_per_step=args.tokens_per_step, routing=args.routing,
                           jobs=args.jobs)
    dry_only = [f"--{n}" for n, v in (("nproc-per-node", args.nproc_per_node != 1),
                                      ("nnodes", args.nnodes != 1), ("ranks", args.ranks),
                                      ("steps", args.steps != 2), ("instance", args.instance),
                                      ("standalone", args.standalone),
                                      ("master-addr", args.master_addr),
                                      ("master-port", args.master_port),
                                      ("tokens-per-step", args.tokens_per_step),
                                      ("routing", args.routing), ("jobs", args.jobs))
                if v]
    if dry_only:
        print(f"neuronlocal run: {', '.join(dry_only)} only apply with --dry-run (use torchrun "
              "to start real ranks)", file=sys.stderr)
        return 2
    return runner.run(args.args, module=args.module, report_dir=args.report)


def cmd_estimate(args: argparse.Namespace) -> int:
    from neuronlocal.estimate import cli as estimate_cli

    return estimate_cli.run(args)


def cmd_serve_plan(args: argparse.Namespace) -> int:
    from neuronlocal.serve import cli as serve_cli

    return serve_cli.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="neuronlocal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the emulated instance: cores, HBM per core, LNC").set_defaults(
        func=cmd_info)
    sub.add_parser("demo", help="a small model on neuron vs CPU").set_defaults(func=cmd_demo)
    p_ops = sub.add_parser("ops", help="op placement: what runs on the host on Trainium")
    p_ops.add_argument("op", nargs="*", help="op names, e.g. aten::mm, sort.stable")
    p_ops.add_argument("--list", choices=["host", "device", "composite"],
                       help="list the ops with this placement (host: every op that runs there)")
    p_ops.set_defaults(func=cmd_ops)
    sub.add_parser("env", help="environment variables (markdown table)").set_defaults(
        func=cmd_env)
    from neuronlocal.support.check import EXIT_HELP
    from neuronlocal.support.configs import TASK_MAPPINGS

    p_check = sub.add_parser("check", help="does a model run on Trainium? (exit 0/1/2/3/4)",
                             epilog=EXIT_HELP)
    p_check.add_argument("model_type", nargs="?", help="a transformers model type, e.g. llama")
    src = p_check.add_mutually_exclusive_group()
    src.add_argument("--config", help="a config.json")
    src.add_argument("--model-dir", help="a local directory with config.json (save_pretrained)")
    p_check.add_argument("--trust-remote-code", action="store_true",
                         help="run the model code a remote-code config (auto_map) names; it "
                              "must be in --model-dir")
    p_check.add_argument("--task", default="causal-lm", choices=list(TASK_MAPPINGS))
    p_check.set_defaults(func=cmd_check)
    p_sup = sub.add_parser("support", help="the model support matrix of a task",
                           epilog="exit status: 0 no neuron failure, 1 some architecture fails "
                                  "on neuron, 2 bad options, 3 nothing could be tested")
    p_sup.add_argument("--task", default="causal-lm", choices=list(TASK_MAPPINGS))
    p_sup.add_argument("-j", "--jobs", type=whole(1, 1024), default=1,
                       help="rows run in parallel (>= 1)")
    p_sup.add_argument("--out", default="reports/support", help="directory for JSON/md/HTML")
    p_sup.add_argument("--timeout", type=amount(0, 10**6), default=600,
                       help="seconds per model (> 0)")
    p_sup.add_argument("--max-memory", type=amount(0, 2**20), default=6.0, metavar="GIB",
                       help="resident memory per model; past it the row is skipped with its "
                            "peak (default 6)")
    p_sup.add_argument("--subset", choices=["ci"], help="only the fixed CI subset")
    p_sup.add_argument("--models", help="comma-separated model types")
    p_sup.add_argument("--force", action="store_true", help="rerun models already done")
    p_sup.add_argument("--list", action="store_true", help="list the task's architectures")
    p_sup.set_defaults(func=cmd_support)
    p_run = sub.add_parser("run", help="run a script and report what it would cost on Trainium")
    p_run.add_argument("--report", default="neuron_report", metavar="DIR",
                       help="where report.html, report.json and rank<N>.json go")
    p_run.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script")
    p_run.add_argument("--dry-run", action="store_true",
                       help="run at full size with no tensor bytes: every simulated rank's "
                            "peak HBM and collectives, without the hardware (docs/dry-run.md)")
    p_run.add_argument("--nproc-per-node", type=whole(1, 128), default=1,
                       help="dry run: ranks per node, as torchrun's")
    p_run.add_argument("--nnodes", type=whole(1, 4096), default=1,
                       help="dry run: nodes (instances), as torchrun's")
    p_run.add_argument("--ranks", help="dry run: ranks to simulate: `all` or e.g. 0,63 "
                                       "(default: rank 0 and the last)")
    p_run.add_argument("--steps", type=whole(0, 10**6), default=2,
                       help="dry run: stop after this many optimizer steps (0: run to the "
                            "end; default 2)")
    p_run.add_argument("--instance", help="dry run: the instance each node is, e.g. "
                                          "trn2.48xlarge")
    p_run.add_argument("--standalone", action="store_true",
                       help="dry run: accepted as torchrun's (a dry run meets no peers)")
    p_run.add_argument("--master-addr", help="dry run: MASTER_ADDR the script sees")
    p_run.add_argument("--master-port", type=whole(1, 65535),
                       help="dry run: MASTER_PORT the script sees")
    p_run.add_argument("--tokens-per-step", type=whole(1, 10**12),
                       help="dry run: the job's tokens per optimizer step, for tokens/s and "
                            "$ (default: the embedding's tokens per rank x world size)")
    p_run.add_argument("--routing", metavar="POLICY",
                       help="dry run: indices of topk/sort/argmax over values the run lacks "
                            "(MoE routing): `balanced` (default) or `hot:<fraction>` on "
                            "expert 0; sets NEURONLOCAL_DRY_RUN_ROUTING")
    p_run.add_argument("--jobs", type=whole(1, 4096),
                       help="dry run: simulated ranks run at once (default: one per CPU core, "
                            "at most the ranks; each holds its own host memory)")
    p_run.add_argument("args", nargs=argparse.REMAINDER, help="script.py [args...]")
    p_run.set_defaults(func=cmd_run)
    from neuronlocal.estimate.cli import add_arguments as estimate_arguments

    p_est = sub.add_parser("estimate", help="step time, throughput and cost of a full-size "
                                            "model on Trainium, with its error band")
    estimate_arguments(p_est)
    p_est.set_defaults(func=cmd_estimate)
    from neuronlocal.serve.cli import add_arguments as serve_arguments

    p_serve = sub.add_parser("serve-plan", help="bucket lists, replicas, capacity, cost and "
                                                "p99 latency for a traffic trace, against "
                                                "powers of two; the cheapest rental for a "
                                                "latency target")
    serve_arguments(p_serve)
    p_serve.set_defaults(func=cmd_serve_plan)
    args = parser.parse_args(argv)
    if args.command in ("check", "support") and _unavailable():
        return 1
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """`neuronlocal ops --list host | head`: the reader closed the pipe. Exit quietly with
    the status a shell gives a command SIGPIPE ended (128 + 13), as `ls | head` does."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # Python's final flush must not fail again
    return 141


if __name__ == "__main__":
    sys.exit(main())
