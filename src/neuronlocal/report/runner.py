"""`neuronlocal run`: run a program in this process with capture on, then write its report.

The target runs through runpy (as `python script.py` / `python -m module` would) with
sys.argv set to its own arguments, inside try/finally, so a script that raises (an OOM,
say) still leaves a report; the exit status is the script's. Under torchrun every rank
writes `rank<N>.json`; then, holding a lock on the report directory, it merges the rank
files present into `report.json` and `report.html`, so the last rank to finish leaves
the complete page (and prints the merged summary).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from neuronlocal.report import collect, render

log = logging.getLogger("neuronlocal.report")


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _target(args: list[str], module: str | None) -> tuple[str, list[str]]:
    if module:
        return module, [module, *args]
    if not args:
        raise SystemExit("neuronlocal run: give a script (or -m module) to run")
    return args[0], list(args)


def run(args: list[str], module: str | None = None, report_dir: str | Path = "neuron_report",
        quiet: bool = False) -> int:
    """Runs `script args...` (or `-m module args...`); returns its exit status."""
    target, argv = _target(args, module)
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = argv
    if not module:
        sys.path.insert(0, str(Path(target).resolve().parent))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"{os.getpid()}-{time.time():.0f}"
    collector = collect.Collector().start()
    code, error = 0, None
    log.info("running %s with the report going to %s", target, out)
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - report any failure, then exit like Python
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        error = {"type": type(e).__name__, "message": str(e),
                 "traceback": "".join(traceback.format_exception(e))}
        traceback.print_exc()
    finally:
        try:
            write(out, collect.snapshot({"exit_code": code, "error": error, "argv": argv,
                                          "run_id": run_id}),
                  quiet=quiet)
        finally:
            collector.stop()
            sys.argv = old_argv
            if not module and sys.path and old_path0 is not None and sys.path[0] != old_path0:
                sys.path.pop(0)
    return code


@contextlib.contextmanager
def _locked(directory: Path):
    with (directory / ".merge.lock").open("a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def merge_dir(directory: Path, run_id: str | None = None) -> dict[str, Any]:
    """Merges the rank<N>.json files of one run (`run_id`; None: all) into report.json/.html."""
    ranks = []
    for p in sorted(directory.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            r = json.loads(p.read_text())
            if run_id is None or r["run"].get("run_id") == run_id:
                ranks.append(r)
    rep = render.merge(ranks)
    render.write_json(rep, directory / "report.json")
    (directory / "report.html").write_text(render.html_page(rep))
    return rep


def write(directory: Path, rank_report: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
    """Writes this rank's JSON, re-merges the directory, prints a summary."""
    rank = rank_report["rank"]
    tmp = directory / f".rank{rank}.json.tmp"
    render.write_json(rank_report, tmp)
    os.replace(tmp, directory / f"rank{rank}.json")
    with _locked(directory):
        rep = merge_dir(directory, rank_report["run"].get("run_id"))
    if not quiet:
        if rep["complete"]:
            render.terminal(rep)
            print(f"neuronlocal: report written to {directory}/report.html and report.json",
                  file=sys.stderr)
        else:
            print(f"neuronlocal: rank {rank} report written to {directory}/rank{rank}.json "
                  f"({len(rep['ranks'])}/{rep['world_size']} ranks so far)", file=sys.stderr)
    return rep
