"""The model support matrix: every architecture of a transformers task, each in its own process.

`neuronlocal support` runs `check_model` (support/models.py) for each architecture of the
installed transformers' mapping in a subprocess with a timeout, so a crash or hang loses
one row, never the run; results are written after every model, so a rerun resumes; `-j`
runs workers in parallel. Output: JSON, a markdown table and a static HTML page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
}
TASK_MODES = {"causal-lm": ("eager", "compile", "generate", "train"),
              "seq2seq": ("eager", "compile", "generate", "train"),
              "masked-lm": ("eager", "compile", "train")}
# The fixed subset CI runs: the most used text-generation families.
CI_SUBSET = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
             "opt", "falcon", "mixtral", "qwen2_moe", "bloom", "starcoder2")
DONE = {"pass", "neuron-fail", "cpu-fail", "unsupported", "timeout", "crash"}


def architectures(task: str) -> list[tuple[str, str]]:
    """(model_type, class name) for every architecture of the task in installed transformers."""
    from transformers.models.auto import modeling_auto

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    mapping = getattr(modeling_auto, TASKS[task])
    out = []
    for model_type, cls in mapping.items():
        out.append((model_type, cls[0] if isinstance(cls, (list, tuple)) else cls))
    return sorted(out)


def run_one(model_type: str, arch: str, task: str, timeout: float) -> dict[str, Any]:
    """check_model in a fresh interpreter; a timeout or crash becomes a row, not an error."""
    cmd = [sys.executable, "-m", "neuronlocal.support.worker", model_type, arch, task]
    env = {**os.environ, "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
           "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "architecture": arch, "status": "timeout",
                "seconds": timeout, "error": f"no result within {timeout:.0f}s", "modes": {}}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"model_type": model_type, "architecture": arch, "status": "crash",
                "seconds": time.perf_counter() - start, "modes": {},
                "error": f"exit {proc.returncode}: " + " | ".join(tail)[-400:]}
    return json.loads(lines[-1])


def load(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())["models"]
    except (ValueError, KeyError, TypeError):
        return {}
    return {r["model_type"]: r for r in rows}


def save(path: Path, task: str, rows: dict[str, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"task": task, "summary": summary(rows.values()),
            "models": sorted(rows.values(), key=lambda r: r["model_type"])}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def summary(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    rows = list(rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    runs_on_cpu = sum(v for k, v in counts.items() if k in {"pass", "neuron-fail"})
    return {"total": len(rows), "counts": counts,
            "pass_rate_of_cpu_runnable": counts.get("pass", 0) / runs_on_cpu if runs_on_cpu else 0}


def run_matrix(task: str, out_dir: Path, jobs: int = 1, timeout: float = 600,
               only: Iterable[str] | None = None, force: bool = False) -> dict[str, Any]:
    from tqdm import tqdm

    from neuronlocal.support import render

    archs = architectures(task)
    if only is not None:
        wanted = set(only)
        archs = [a for a in archs if a[0] in wanted]
    json_path = out_dir / f"support-{task}.json"
    rows = load(json_path)
    if force:  # rerun the selected architectures, keep the other rows
        for model_type, _ in archs:
            rows.pop(model_type, None)
    todo = [a for a in archs if rows.get(a[0], {}).get("status") not in DONE]
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool, \
            tqdm(total=len(archs), initial=len(archs) - len(todo), desc=f"support {task}",
                 unit="model") as bar:
        futures = {pool.submit(run_one, mt, arch, task, timeout): mt for mt, arch in todo}
        for fut in as_completed(futures):
            row = fut.result()
            rows[row["model_type"]] = row
            save(json_path, task, rows)
            bar.set_postfix_str(f"{row['model_type']}: {row['status']}")
            bar.update()
    save(json_path, task, rows)
    render.write_all(out_dir, task, json.loads(json_path.read_text()))
    return json.loads(json_path.read_text())
