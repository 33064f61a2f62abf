"""The model support matrix: every architecture of a transformers task, each in its own process.

`neuronlocal support` runs `check_model` (support/models.py) for each architecture of the
installed transformers' mapping in a process forked from a forkserver that has the imports
done (support/worker.py). A row that runs past `timeout` is a timeout; one whose resident
memory passes `max_memory` is killed and skipped with its measured peak; a crash loses only
its row. Results (JSON, markdown, HTML) are rewritten after every row, so an interrupted run
keeps what it did and a rerun resumes; `-j` runs rows in parallel.
"""

from __future__ import annotations

import difflib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from neuronlocal.core.config import env_str
from neuronlocal.core.files import read_json, write_private
from neuronlocal.support.configs import TASK_MAPPINGS, BadInput

TASKS = tuple(TASK_MAPPINGS)
# The fixed subset CI runs: the most used text-generation families.
CI_SUBSET = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
             "opt", "falcon", "mixtral", "qwen2_moe", "bloom", "starcoder2")
DONE = {"pass", "neuron-fail", "cpu-fail", "build-fail", "skipped", "timeout", "crash"}
TESTED = ("pass", "neuron-fail")  # rows where CPU and neuron were both run and compared
# Rows run first, so a sweep stopped early has answered for the most used families: the
# CI subset, then the most used families of the other tasks.
FIRST = CI_SUBSET + ("t5", "bart", "mbart", "marian", "pegasus", "bert", "roberta",
                     "distilbert", "deberta-v2", "xlm-roberta", "modernbert", "vit", "deit",
                     "convnext", "resnet", "swin", "dinov2")
NOT_RUN = "not-run"
GiB = 2**30
_POLL = 0.25
# Rows compile at optimisation level 1 (unless NEURON_CC_FLAGS says otherwise): what a row
# tests is whether each graph compiles and matches CPU, not how fast its kernels run, and
# compiling is most of a row's time.
MATRIX_CC_FLAGS = "-O1"


def worker_env() -> dict[str, str]:
    """The environment a row runs with, set in the row's own process (never in the caller's):
    a graph that fails to compile is a failure, and the matrix's optimisation level."""
    return {"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
            "NEURON_CC_FLAGS": env_str("NEURON_CC_FLAGS") or MATRIX_CC_FLAGS}
_ctx_lock = threading.Lock()
_ctx: Any = None


def architectures(task: str) -> list[tuple[str, str]]:
    """(model_type, class name) for every architecture of the task in installed transformers."""
    from transformers.models.auto import modeling_auto

    if task not in TASKS:
        raise BadInput(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    mapping = getattr(modeling_auto, TASK_MAPPINGS[task][0])
    out = []
    for model_type, cls in mapping.items():
        out.append((model_type, cls[0] if isinstance(cls, (list, tuple)) else cls))
    return sorted(out)


def select(task: str, only: Iterable[str] | None) -> list[tuple[str, str]]:
    """The architectures to run; unknown model types are a BadInput naming close matches."""
    archs = architectures(task)
    if only is None:
        return archs
    wanted = [m.strip() for m in only if m.strip()]
    known = {mt for mt, _ in archs}
    unknown = [m for m in wanted if m not in known]
    if not wanted or unknown:
        hints = []
        for m in unknown:
            close = difflib.get_close_matches(m, known, n=3)
            hints.append(f"{m!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise BadInput(f"--models: no {task} architecture named {', '.join(hints)}; "
                       f"{len(known)} are known (`neuronlocal support --list --task {task}`)."
                       if unknown else "--models: give at least one model type.")
    return [a for a in archs if a[0] in set(wanted)]


def check_out_dir(out_dir: Path) -> None:
    """Fails before anything runs if results could not be written to `out_dir`."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as e:
        raise BadInput(f"--out {out_dir}: cannot write there ({e.strerror or e}); "
                       "choose a writable directory.") from e


def _context() -> Any:
    """One forkserver per run, with the worker's imports done and Inductor warmed once."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["neuronlocal.support.preload"])
            _ctx = ctx
        return _ctx


def _status_kib(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


def _timed_out(base: dict[str, Any], task: str, result: Path, timeout: float, elapsed: float,
               peak: int) -> dict[str, Any]:
    """A timeout row, with the modes that finished before it (from the worker's partial
    row) and the mode that was still running."""
    from neuronlocal.support.models import TASK_MODES

    row = {**base, "status": "timeout", "seconds": elapsed, "peak_rss": peak}
    partial = result.with_name(result.name + ".partial")
    try:
        row["modes"] = json.loads(partial.read_text())["modes"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    running = next((m for m in TASK_MODES[task] if m not in row["modes"]), None)
    done = ", ".join(f"{m} " + ("pass" if r.get("neuron_ok") else "neuron-fail"
                                if r.get("cpu_ok") else "cpu-fail")
                     for m, r in row["modes"].items())
    row["error"] = (f"no result within {timeout:.0f}s"
                    + (f": mode {running} still running" if running else "")
                    + (f" (finished: {done})" if done else ""))
    return row


def run_one(model_type: str, arch: str, task: str, timeout: float,
            max_memory: float = 6 * GiB, threads: int = 1) -> dict[str, Any]:
    """One row in a forked worker with `threads` intra-op threads; a timeout, memory kill or
    crash becomes a row."""
    from neuronlocal.support import worker

    base = {"model_type": model_type, "architecture": arch, "modes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="neuronlocal-support-"))
    result, log = tmp / "row.json", tmp / "log.txt"
    proc = _context().Process(target=worker.run_to_file,
                              args=(model_type, arch, task, str(result), str(log),
                                    worker_env(), threads))
    start = time.perf_counter()
    peak = 0
    try:
        proc.start()
        while proc.is_alive():
            proc.join(_POLL)
            mem = _status_kib(proc.pid or 0)
            peak = max(peak, mem.get("VmHWM", 0) * 1024)
            elapsed = time.perf_counter() - start
            if mem.get("VmRSS", 0) * 1024 > max_memory:
                proc.kill()
                proc.join()
                return {**base, "status": "skipped", "seconds": elapsed, "peak_rss": peak,
                        "error": f"memory: resident set passed the bound of "
                                 f"{max_memory / GiB:.1f} GiB (peak {peak / GiB:.2f} GiB); "
                                 "rerun with a larger --max-memory to test it"}
            if elapsed > timeout:
                proc.kill()
                proc.join()
                return _timed_out(base, task, result, timeout, elapsed, peak)
        if proc.exitcode != 0 or not result.exists():
            return {**base, "status": "crash", "seconds": time.perf_counter() - start,
                    "peak_rss": peak,
                    "error": f"exit {proc.exitcode}: {_tail(log)}"}
        row = json.loads(result.read_text())
        row["peak_rss"] = peak
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of a results file. A damaged one is kept aside (renamed with a `.damaged-`
    suffix) and said so on stderr, so the next save never drops its rows silently."""
    if not os.path.lexists(path):
        return {}
    try:
        return {r["model_type"]: r for r in read_json(path)["models"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-"
                               f"{os.getpid()}")
        os.replace(path, aside)
        print(f"warning: {path} is damaged ({type(e).__name__}: {str(e)[:200]}); kept it as "
              f"{aside} and started a new results file (repair it and copy its rows back, or "
              "rerun them)", file=sys.stderr)
        return {}


def summary(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The one set of numbers every page states (markdown, HTML, README)."""
    rows = list(rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    tested = sum(counts.get(s, 0) for s in TESTED)
    mode_seconds: dict[str, float] = {}
    for r in rows:
        for mode, m in r.get("modes", {}).items():
            mode_seconds[mode] = mode_seconds.get(mode, 0.0) + float(m.get("seconds") or 0)
    return {"total": len(rows), "counts": dict(sorted(counts.items())), "tested": tested,
            "untested": len(rows) - tested, "passed": counts.get("pass", 0),
            "pass_rate_of_tested": counts.get("pass", 0) / tested if tested else 0.0,
            "row_seconds": sum(float(r.get("seconds") or 0) for r in rows),
            "mode_seconds": mode_seconds}


def save(path: Path, task: str, rows: dict[str, dict[str, Any]],
         run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Writes the JSON atomically and returns what was written."""
    import torch
    import transformers

    for r in rows.values():
        r["fallback_op_count"] = len(r.get("fallback_ops") or {})
    data = {"task": task, "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0], "summary": summary(rows.values()),
            "run": run or {}, "models": sorted(rows.values(), key=lambda r: r["model_type"])}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(data, indent=1, default=str), mode=0o644)
    return data


def _previous_run(path: Path) -> dict[str, Any]:
    try:
        run = read_json(path).get("run")
    except (OSError, ValueError, AttributeError):
        return {}
    return run if isinstance(run, dict) else {}


def merge_run(previous: dict[str, Any], this: dict[str, Any], resumed: bool) -> dict[str, Any]:
    """The JSON's `run` record: how the sweep that produced the rows ran.

    A run over every architecture is the sweep (a resumed one adds its rows and wall time to
    the sweep it continues); a run of chosen rows (`--models`) keeps the sweep's record and
    is listed under `reruns`, so rerunning one row never passes off as the whole sweep."""
    if "models" in this:  # chosen rows
        return {**previous, "reruns": [*previous.get("reruns", []), this]}
    if not resumed:  # --force over every architecture: a new sweep
        return dict(this)
    if not this["rows_run"]:  # nothing was left to run
        return previous or dict(this)
    merged = {**this, "reruns": previous.get("reruns", [])}
    if previous.get("rows_run"):  # continues an interrupted sweep
        merged.update(rows_run=previous["rows_run"] + this["rows_run"],
                      wall_seconds=round(previous.get("wall_seconds", 0.0)
                                         + this["wall_seconds"], 1),
                      resumed=previous.get("resumed", 0) + 1)
    if not merged["reruns"]:
        del merged["reruns"]
    return merged


def run_order(archs: Iterable[tuple[str, str]], took: dict[str, float]
              ) -> list[tuple[str, str]]:
    """FIRST's rows in its order, then the rest longest first by `took` (seconds a row took
    last time, unknown as 0), so a sweep does not end with one job on a long row while the
    others idle."""
    return sorted(archs, key=lambda a: (FIRST.index(a[0]) if a[0] in FIRST else len(FIRST),
                                        -took.get(a[0], 0.0), a[0]))


def run_matrix(task: str, out_dir: Path, jobs: int = 1, timeout: float = 600,
               only: Iterable[str] | None = None, force: bool = False,
               max_memory: float = 6 * GiB) -> dict[str, Any]:
    from tqdm import tqdm

    from neuronlocal.support import render

    if jobs < 1:
        raise BadInput(f"-j/--jobs must be at least 1, got {jobs}.")
    if not timeout > 0:
        raise BadInput(f"--timeout must be a positive number of seconds, got {timeout:g}.")
    if not max_memory > 0:
        raise BadInput("--max-memory must be a positive number of GiB.")
    archs = select(task, only)
    check_out_dir(out_dir)
    json_path = out_dir / f"support-{task}.json"
    rows = load(json_path)
    took = {mt: float(row.get("seconds") or 0.0) for mt, row in rows.items()}
    if force:  # rerun the selected architectures, keep the other rows
        for model_type, _ in archs:
            rows.pop(model_type, None)
    for mt, arch in architectures(task):  # every architecture has a row, run or not
        rows.setdefault(mt, {"model_type": mt, "architecture": arch, "status": NOT_RUN,
                             "modes": {}, "seconds": 0.0})
    todo = run_order([a for a in archs if rows[a[0]].get("status") not in DONE], took)
    threads = max(1, (os.cpu_count() or 1) // jobs)  # rows side by side share the cores
    this = {"jobs": jobs, "threads_per_row": threads, "timeout": timeout,
            "max_memory_gib": max_memory / GiB,
            "compiler_flags": worker_env()["NEURON_CC_FLAGS"],
            "rows_run": len(todo), "wall_seconds": 0.0}
    if only is not None:
        this["models"] = sorted(mt for mt, _ in todo)
    previous = _previous_run(json_path)
    start = time.perf_counter()
    lock = threading.Lock()

    def write() -> dict[str, Any]:
        this["wall_seconds"] = round(time.perf_counter() - start, 1)
        data = save(json_path, task, rows, merge_run(previous, this, resumed=not force))
        render.write_all(out_dir, task, data)
        return data

    data = write()
    with ThreadPoolExecutor(max_workers=jobs) as pool, \
            tqdm(total=len(archs), initial=len(archs) - len(todo), desc=f"support {task}",
                 unit="model") as bar:
        futures = {pool.submit(run_one, mt, arch, task, timeout, max_memory, threads): mt
                   for mt, arch in todo}
        for fut in as_completed(futures):
            row = fut.result()
            with lock:
                rows[row["model_type"]] = row
                data = write()
            bar.set_postfix_str(f"{row['model_type']}: {row['status']}")
            bar.update()
    return data
